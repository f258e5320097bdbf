"""pyinfra deploy: Qwen 3.5 on vLLM. Usage: pyinfra inventories/lab.py deploys/qwen35.py [--dry] [--limit HOST]
from a checkout, or `gpufleet deploy INVENTORY [--dry] [--limit HOST]` from an installed gpufleet.

Thin entry point; the work lives in gpufleet.vllm.deploy (docs/deploy.md). Shipped in the package (the
checkout's deploys/qwen35.py is a link to this file), so `gpufleet deploy` and `gpufleet rollout` find it without a
checkout. Not a module to import: pyinfra executes it.
"""

from pyinfra import host

from gpufleet.harness import register_deploy_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.deploy import deploy_qwen35

register_deploy_file(__file__)  # keeps pyinfra's per-operation stack walk cheap
deploy_qwen35(_sudo=use_sudo(host))
