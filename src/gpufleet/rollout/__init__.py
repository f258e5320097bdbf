"""`gpufleet rollout`, `history` and `rollback`: move a fleet to one image digest, host by host, in place.

    run.py                the three commands end to end, as library calls the CLI renders
    replicas.py           the inventory's hosts and their SSH sessions
    ledgers.py            each host's ledger, read over SSH (gpufleet.hoststate.reader)
    target.py             the one target digest: as given, or a tag looked up once
    deploy.py             one run of the deploy on some hosts (RunSettings in, the run's result file out)
    prepare.py            the slow part (pull, model, flag check) on every host, while the old version serves
    drain.py              wait until a host runs no request before its restart
    downtime.py           a host's downtime during its swap, measured from the controller
    swap.py               the canary, then batches: drain, deploy, outcome from the ledger
    carry.py              the canary's compile cache carried to the later hosts (carry_entries, carry_eligibility,
                          carry_stream, compile_factors); warm_start.py reads whether a host started warm
    routers.py            each swapped replica out of the routers' worker sets and back (membership.py: who belongs)
    settle.py             the routers' reconcile without a rollout (`gpufleet status --fix`)
    gpu.py                the hosts a rollout skips for their GPUs
    group.py              a replica group as one replica: its ranks swapped, done and skipped together
    report.py             per-host outcomes, the table and the --json document; progress.py the live view
"""
