"""The local simulated GPU fleet that `gpufleet sandbox up` started (needs it running first).

    sudo gpufleet sandbox up 2
    pyinfra inventories/sandbox.py deploys/qwen35.py

Host data points the deploy at the sandbox's services (registry image, the stand-in NVIDIA and Docker repos, the
stand-in model repo); see gpufleet.sandbox.inventory.
"""

import os
from pathlib import Path

from gpufleet.sandbox.inventory import pyinfra_hosts, site_cache_hosts

_INVENTORY = Path(os.environ.get("GPUFLEET_SANDBOX_DIR", "/var/lib/gpufleet/sandbox")) / "inventory.json"
if not _INVENTORY.exists():
    raise SystemExit(f"no sandbox inventory at {_INVENTORY}: run `sudo gpufleet sandbox up` first")

gpuhosts = pyinfra_hosts(_INVENTORY)
routers = pyinfra_hosts(_INVENTORY, routers=True)  # `gpufleet sandbox up N --routers 1`; deploys/router.py
site_cache = site_cache_hosts(_INVENTORY)  # `gpufleet sandbox up N --site-cache`: gpuhost1 (docs/site-cache.md)
