"""Stand-in for ``nemo_rl.models`` (NeMo-RL is not installable from the package index)."""
