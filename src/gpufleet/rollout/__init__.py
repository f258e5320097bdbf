"""`gpufleet rollout`, `history` and `rollback`: move a fleet to one image digest, host by host, in place.

One module per responsibility:
    fleet.py     the inventory's hosts (spec + host data) and how to reach each one (SSH, like `gpufleet status`)
    ledgers.py   read each host's ledger (gpufleet.hoststate.ledger) over SSH: what is committed, pending, failed
    target.py    the target digest: a digest as given, or a tag looked up ONCE in the registry from one host (no pull)
    deploy.py    one run of the deploy (pyinfra, deploys/qwen35.py) on some hosts with the rollout's settings
    prepare.py   the prepare stage on every host to swap (pull, model, flag check), while the old version serves
    drain.py     wait for a host's running requests to reach 0 before its restart
    downtime.py  a host's /health watched from the controller while it swaps: its downtime, measured
    swap.py      canary then batches: drain, deploy, outcome from the ledger; stop on the first failed gate
    routers.py   the inventory's routers: each swapped replica out of their worker sets, and back after its outcome
    settle.py    the routers' reconcile without a rollout (`gpufleet status --fix`)
    report.py    per-host outcomes, the final table and the --json document
    progress.py  the live per-host view on stderr
"""
