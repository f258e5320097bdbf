"""pyinfra deploy: vllm-router in front of the fleet. Usage: pyinfra inventories/lab.py deploys/router.py [--dry]

Thin entry point; the work lives in gpufleet.router.deploy (docs/router.md). Router hosts are the inventory's
`routers` group; every other host is a replica, routed to when it verifies ready.
"""

from pyinfra import host

from gpufleet.operations.remote import use_sudo
from gpufleet.router.deploy import deploy_router

deploy_router(_sudo=use_sudo(host))
