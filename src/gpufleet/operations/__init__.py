"""pyinfra operations for gpufleet. Each decides from the host snapshot (gpufleet.facts.host) and yields commands
or calls host.noop(reason); values only known while executing (the pinned image digest) come from
gpufleet.operations.context, filled by the operation that resolved them.
"""
