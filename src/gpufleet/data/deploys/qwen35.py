"""pyinfra deploy: Qwen 3.5 on vLLM, run by `gpufleet deploy INVENTORY` or `pyinfra INVENTORY deploys/qwen35.py`.

The work lives in gpufleet.vllm.deploy (docs/deploy.md); pyinfra executes this file.
"""

from pyinfra import host

from gpufleet.harness import register_deploy_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.deploy import deploy_qwen35

register_deploy_file(__file__)  # keeps pyinfra's stack walk cheap
deploy_qwen35(_sudo=use_sudo(host))
