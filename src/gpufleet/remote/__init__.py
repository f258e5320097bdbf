"""Reaching hosts: SSH through pyinfra's connector (ssh.py) and HTTP to a host's own loopback over that session
(transport.py). Deploys, the rollout, the router and the health checks reach hosts only through here.

pyinfra's connector is gevent code: hosts connect in parallel only over gevent's sockets, and gevent's patching must
come before any thread or pyinfra State exists in the process ("cannot release un-acquired lock" otherwise). It is
done here, once, by whatever first imports this package (pyinfra's own CLI does the same on import).
"""

from gevent import monkey

if not monkey.is_module_patched("socket"):
    monkey.patch_all()
