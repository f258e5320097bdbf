"""pyinfra deploy: Qwen 3.5 on vLLM, as installed with the package. Usage: gpufleet deploy INVENTORY [--dry] [--limit HOST]

The packaged copy of the checkout's deploys/qwen35.py (the same statements: tests/unit/test_cli_deploy_init.py),
so the deploy runs from an installed gpufleet without a checkout; `gpufleet deploy` and `gpufleet rollout` run it.
The work lives in gpufleet.deploys.qwen35 (docs/deploy.md). Not a module to import: pyinfra executes it.
"""

from pyinfra import host

from gpufleet.deploys import register_deploy_file
from gpufleet.deploys.qwen35 import deploy_qwen35
from gpufleet.remote.ssh import use_sudo

register_deploy_file(__file__)  # keeps pyinfra's per-operation stack walk cheap
deploy_qwen35(_sudo=use_sudo(host))
