"""Turn bare GPU hosts into vLLM servers, and keep the fleet current."""

__version__ = "0.1.0"
