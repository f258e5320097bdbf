"""vllm-router in front of the fleet: one endpoint for every agent, routed to the replica that holds its prefix.

The router is vLLM's own (PyPI `vllm-router`, a Rust binary in a wheel); gpufleet installs it into a venv on the
inventory's `routers` hosts, runs it as a systemd unit in front of the replicas that verify ready, reads its state
for `gpufleet status` and `gpufleet verify`, and takes a replica out of its worker set and back for a rollout. What
the router is and does, measured: docs/router.md.

    settings.py    host data -> RouterSpec (one-line errors), the workers from the inventory
    spec.py        RouterSpec: the only place the router's argv and pip install argv are built
    wheels.py      the lock of its wheels (relock.py regenerates it)
    unit.py        the systemd unit and the front door's nginx site
    facts.py       what is on a router host (one command, pure parser)
    operations.py  pyinfra operations: venv + package, unit, running, workers in step, ready
    deploy.py      the deploy (deploys/router.py is its entry point)
    api.py         its admin HTTP API and metrics, asked on the router host
    status.py      the router's workers, their health and its routing metrics, read over SSH
    check.py       is a router serving the fleet? (gpufleet verify)
    workers.py     take a replica out of the worker set and put it back (rollouts)
"""
