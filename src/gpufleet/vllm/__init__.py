"""The vLLM slice: a GPU host serving one model with vLLM's Docker image under systemd. Same shape as the router's
slice (gpufleet.router): settings, spec, unit, facts, operations, deploy; plus the serving profiles, what vLLM's CLI
accepts (flags), the offline lint, the host checks preflight runs (checks) and the verify that commits a version.
Replica groups, one model across hosts (docs/multi-node.md): group, group_specs, group_deploy, group_verify and
operations/group."""
