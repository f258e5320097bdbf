"""pyinfra operations every slice shares: what an operation yields and how it fails a host (base), files written
atomically and by checksum (files), secrets pyinfra never prints (secret), and the run's own state (run: one typed
context per pyinfra run, each host's snapshot, ledger, lock and problems in it). Each slice's own operations
(gpufleet.vllm.operations, gpufleet.router.operations, gpufleet.sitecache.operations) take their inputs as arguments
and yield commands or call host.noop(reason)."""
