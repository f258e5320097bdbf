"""Turn bare GPU hosts into vLLM servers for Qwen 3.5, and keep the fleet current."""

__version__ = "0.1.0"
