"""Stand-in for ``nemo_rl.models.generation`` (NeMo-RL is not installable from the package index)."""
