"""Stand-in for ``nemo_rl.experience`` (NeMo-RL is not installable from the package index)."""
