"""Two in-memory tasks for tests/verifiers_cases/driver.py: a verifiers 0.4.0 taskset package,
loaded by id (``TasksetConfig(id="vf_tiny_taskset")``). Verifiers' loader takes the one ``Taskset``
subclass a module exports in ``__all__``."""

import verifiers.v1 as vf

__all__ = ["TinyTaskset"]

PROMPTS = ["Plan a three-day trip to Lisbon.", "Help me choose a first programming language."]


class TinyTaskset(vf.Taskset):
    def load(self):
        for idx, prompt in enumerate(PROMPTS):
            yield vf.Task(vf.TaskData(idx=idx, prompt=prompt), self.config.task)
