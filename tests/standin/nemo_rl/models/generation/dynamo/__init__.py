"""Stand-in for ``nemo_rl.models.generation.dynamo`` (NeMo-RL is not installable from the package index)."""
