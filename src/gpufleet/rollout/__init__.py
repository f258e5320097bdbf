"""`gpufleet rollout`, `history` and `rollback`: move a fleet to one image digest, host by host, in place.

    commands.py           the three commands end to end, as library calls the CLI renders
    context.py            what every step of one rollout reads, built once
    replicas.py           the inventory's hosts and their SSH sessions
    ledgers.py            each host's ledger, read over SSH
    target.py             the one target digest: as given, or a tag looked up once
    deploy_run.py         one run of the deploy on some hosts
    prepare.py            the pull, model and flag check on every host, while the old version serves
    drain.py              wait until a host runs no request before its restart
    downtime.py           a host's downtime during its swap, measured from the controller
    swap.py               the canary, then batches: drain, deploy, outcome from the ledger
    carry.py              the canary's compile cache carried to the later hosts (carry_*.py, compile_factors.py)
    warm_start.py         whether a host started warm
    routers.py            each swapped replica out of the routers' worker sets and back (membership.py: who belongs)
    settle.py             the routers' reconcile without a rollout (`gpufleet status --fix`)
    gpu.py                the hosts a rollout skips for their GPUs
    group.py              a replica group as one replica
    report.py             per-host outcomes, the table and the --json document; progress.py the live view
    deploy.py             an alias of deploy_run.pyinfra_command for gpufleet.cli.deploy
"""
