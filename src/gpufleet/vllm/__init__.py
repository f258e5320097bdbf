"""The vLLM slice: a GPU host serving one model with vLLM's Docker image under systemd (docs/architecture.md).

The group* modules serve one model across hosts (docs/multi-node.md)."""
