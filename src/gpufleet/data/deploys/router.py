"""pyinfra deploy: vllm-router in front of the fleet, on the `routers` inventory group (docs/router.md).

The work lives in gpufleet.router.deploy; pyinfra executes this file.
"""

from pyinfra import host

from gpufleet.harness import register_deploy_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.router.deploy import deploy_router

register_deploy_file(__file__)  # keeps pyinfra's stack walk cheap
deploy_router(_sudo=use_sudo(host))
