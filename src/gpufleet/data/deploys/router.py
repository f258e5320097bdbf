"""pyinfra deploy: vllm-router in front of the fleet. Usage: pyinfra inventories/lab.py deploys/router.py [--dry]
from a checkout; `gpufleet deploy INVENTORY` runs it after the vLLM hosts converged, when the inventory has a
`routers` group.

Thin entry point; the work lives in gpufleet.router.deploy (docs/router.md). Router hosts are the inventory's
`routers` group; every other host is a replica, routed to when it verifies ready. Shipped in the package (the
checkout's deploys/router.py is a link to this file). Not a module to import: pyinfra executes it.
"""

from pyinfra import host

from gpufleet.harness import register_deploy_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.router.deploy import deploy_router

register_deploy_file(__file__)  # keeps pyinfra's per-operation stack walk cheap
deploy_router(_sudo=use_sudo(host))
