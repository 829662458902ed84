from rllm.environments.base.base_env import BaseEnv

__all__ = ["BaseEnv"]
