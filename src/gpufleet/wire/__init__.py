"""Pure rules over what vLLM and a host send, written once for facts, lint, operations, health and the router."""
