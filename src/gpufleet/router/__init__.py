"""vllm-router in front of the fleet: one endpoint for every agent, routed to the replica that holds its prefix.

docs/router.md describes the router, the deploy and each module.
"""
