"""`gpufleet rollout`, `history` and `rollback`: move a fleet to one image digest, host by host (docs/rollout.md).

commands.py     the three commands, as library calls the CLI renders
context.py      what every step of one rollout reads
hosts.py        the inventory's hosts and their SSH sessions
ledgers.py      each host's ledger
target.py       the one target digest
deploy_run.py   one run of the deploy on some hosts
prepare.py      the pull, model and flag check, while the old version serves
drain.py        wait until a host runs no request
downtime.py     a host's downtime during its swap
swap.py         the canary, then batches
carry.py        the canary's compile cache carried to later hosts (carry_*.py, compile_factors.py, warm_start.py)
routers.py      replicas out of the routers and back (membership.py: who belongs; settle.py: status --fix)
gpu.py          the hosts skipped for their GPUs
group.py        a replica group as one replica
report.py       per-host outcomes and the table (progress.py: the live view)
"""
