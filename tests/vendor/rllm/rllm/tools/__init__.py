# Not rLLM's own: its rllm/tools/__init__.py imports every built-in tool (code sandboxes, web search
# clients, and through them the reward functions), none of which the workflow rollout path uses. The
# rollout path imports only rllm.tools.tool_base and rllm.tools.utils, copied unchanged.
