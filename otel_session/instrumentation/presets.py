"""Framework presets: each framework's one-rollout function as a trajectory boundary, with its group.

Each is on whenever its framework is imported (an entry point, as NeMo-RL's ``otel_session_nemo_rl``):
nothing to set beyond the router's hosts. The names and group keys were read from each framework's
source (docs/integrations.md says which release); a name a version lacks is skipped without a word,
and ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=otel_session_<name>`` turns one off.
"""

from __future__ import annotations

from otel_session.instrumentation.boundaries import TrajectoryFunctionsInstrumentor


class RLLMInstrumentor(TrajectoryFunctionsInstrumentor):
    """rLLM (entry point ``otel_session_rllm``): ``Workflow.run_with_termination_handling(task, uid)``
    runs one rollout for every workflow class (none overrides it), and the workflow engines call it
    with ``uid=f"{task_id}:{rollout_idx}"`` again on each retry, so each retry is a new attempt and
    the rollouts of one task are siblings."""

    library = "rllm"
    requirement = "rllm"
    presets = ("rllm.workflows.workflow:Workflow.run_with_termination_handling[group=uid|before_last(:)]",)


class TRLAsyncGRPOInstrumentor(TrajectoryFunctionsInstrumentor):
    """TRL's experimental async GRPO (entry point ``otel_session_trl``): ``_AsyncRolloutLoop.
    _generate_one`` runs one conversation, all its turns posted with aiohttp from the spawned rollout
    process; the ``num_generations`` rollouts of one dataset row share its ``group_id``."""

    library = "trl"
    requirement = "trl"
    presets = (
        "trl.experimental.async_grpo.async_rollout_worker:_AsyncRolloutLoop._generate_one[group=group_id]",
        # The OpenEnv variant overrides it, running each session in a thread pool.
        "trl.experimental.async_grpo.openenv_harness:_HarnessRolloutLoop._generate_one[group=group_id]",
    )


class ArealInstrumentor(TrajectoryFunctionsInstrumentor):
    """AReaL's built-in workflows (entry point ``otel_session_areal``): each ``arun_episode(engine,
    data)`` is one episode, every turn of it an ``engine.agenerate`` request; ``GroupedRolloutWorkflow``
    hands one prompt's siblings the same ``data``, so its messages, digested, are their group."""

    library = "areal"
    requirement = "areal"
    presets = (
        "areal.workflow.multi_turn:MultiTurnWorkflow.arun_episode[group=data.messages|digest]",
        "areal.workflow.rlvr:RLVRWorkflow.arun_episode[group=data.messages|digest]",
        "areal.workflow.vision_rlvr:VisionRLVRWorkflow.arun_episode[group=data.messages|digest]",
    )
