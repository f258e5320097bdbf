"""pyinfra deploy: vllm-router in front of the fleet, as installed with the package. Usage: gpufleet deploy INVENTORY

The packaged copy of the checkout's deploys/router.py (the same statements: tests/unit/test_cli_deploy_init.py);
`gpufleet deploy` runs it after the vLLM hosts converged, when the inventory has a `routers` group. The work lives
in gpufleet.router.deploy (docs/router.md). Not a module to import: pyinfra executes it.
"""

from pyinfra import host

from gpufleet.deploys import register_deploy_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.router.deploy import deploy_router

register_deploy_file(__file__)  # keeps pyinfra's per-operation stack walk cheap
deploy_router(_sudo=use_sudo(host))
