"""The demo side of otel-session: a real NVIDIA Dynamo stack on loopback and the tools around it.

``LocalDynamo`` (frontend + mocker workers), the rollout ``workload`` the CLI and benchmarks run,
``doctor`` and the ``otel-session`` command (``cli``). It is a user of the library like any other:
the library itself never imports this package.

Dynamo 1.6.1 by default; another version (NeMo-RL pins 1.3.0.post1) runs from its own interpreter.

Importing this package is cheap: Dynamo itself is only needed (and installed on demand) when a
:class:`LocalDynamo` starts.
"""

from ._install import DYNAMO_VERSION, DynamoInstallError, ensure_dynamo_installed, missing_dynamo_modules
from ._model import ensure_model_dir
from ._nvext import NVEXT_EXTRA_BODY, cached_tokens_of, ttft_ms_of, worker_id_of
from ._ports import reserve_port
from ._stack import ENV_DYNAMO_PYTHON, DynamoProcess, DynamoStartError, LocalDynamo, dynamo_version_of

__all__ = [
    "DYNAMO_VERSION",
    "ENV_DYNAMO_PYTHON",
    "NVEXT_EXTRA_BODY",
    "DynamoInstallError",
    "DynamoProcess",
    "DynamoStartError",
    "LocalDynamo",
    "cached_tokens_of",
    "dynamo_version_of",
    "ensure_dynamo_installed",
    "ensure_model_dir",
    "missing_dynamo_modules",
    "reserve_port",
    "ttft_ms_of",
    "worker_id_of",
]
