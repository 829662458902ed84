"""Stand-in for NeMo-RL (NVIDIA-NeMo/RL), which is not installable from the package index.

Only the names and call shapes otel-session's NeMo-RL boundary depends on, much smaller than the real
modules (read at NVIDIA-NeMo/RL 7ea279a). Importable as ``nemo_rl`` with ``tests/standin`` on
``PYTHONPATH``; used by tests/test_nemo_rl_boundaries.py.
"""
