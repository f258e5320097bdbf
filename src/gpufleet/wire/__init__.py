"""The wire: pure rules over what vLLM and a host send (no network, no pyinfra). Facts, lint, operations, health and
the router all read them here, so the rules that decide "ready", "serving what it should" and "legal on this server"
are written once.

    evidence.py      excerpt(): server-sent text quoted on one line
    metrics.py       /metrics through prometheus_client's parser, reduced to what the checks need
    identity.py      Expected, served_models, identity_problems
    geometry.py      resolved block sizes and the legal prefix-match unit and batch
    checks.py        the names of the checks a version is held to
    speed.py         a version's speed figures and the rule that holds a new version to the old one's
    gpu_verdicts.py  the GPU verdict table, NVIDIA's action per verdict, its two settings
"""
