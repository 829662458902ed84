"""A real NVIDIA Dynamo 1.6.1 stack (frontend + mocker workers) on loopback, for tests, demos, benchmarks.

Importing this package is cheap: Dynamo itself is only needed (and installed on demand) when a
:class:`LocalDynamo` starts.
"""

from ._install import DYNAMO_VERSION, DynamoInstallError, ensure_dynamo_installed
from ._model import ensure_model_dir
from ._nvext import NVEXT_EXTRA_BODY, cached_tokens_of, ttft_ms_of, worker_id_of
from ._stack import DynamoProcess, DynamoStartError, LocalDynamo

__all__ = [
    "DYNAMO_VERSION",
    "NVEXT_EXTRA_BODY",
    "DynamoInstallError",
    "DynamoProcess",
    "DynamoStartError",
    "LocalDynamo",
    "cached_tokens_of",
    "ensure_dynamo_installed",
    "ensure_model_dir",
    "ttft_ms_of",
    "worker_id_of",
]
