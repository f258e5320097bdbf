"""The local simulated GPU fleet that `gpufleet sandbox up` started (needs it running first).

    gpufleet sandbox up 2                              # in a root shell: the sandbox is root's
    pyinfra inventories/sandbox.py deploys/qwen35.py

Host data points the deploy at the sandbox's services (registry image, the stand-in NVIDIA and Docker repos, the
stand-in model repo); see gpufleet.sandbox.inventory.
"""

import os
from pathlib import Path

from gpufleet.sandbox.inventory import pyinfra_hosts, site_cache_hosts

_INVENTORY = Path(os.environ.get("GPUFLEET_SANDBOX_DIR", "/var/lib/gpufleet/sandbox")) / "inventory.json"
if _INVENTORY.parent.is_dir() and not os.access(_INVENTORY.parent, os.R_OK | os.X_OK):
    # The state dir holds the fleet's SSH key: root's only.
    raise SystemExit(
        f"{_INVENTORY.parent} is root's (it holds the sandbox's SSH key): run pyinfra in the root shell "
        "that ran `gpufleet sandbox up`"
    )
if not _INVENTORY.exists():
    raise SystemExit(f"no sandbox inventory at {_INVENTORY}: run `gpufleet sandbox up` (as root) first")

gpuhosts = pyinfra_hosts(_INVENTORY)
routers = pyinfra_hosts(_INVENTORY, routers=True)  # `gpufleet sandbox up N --routers 1`; deploys/router.py
site_cache = site_cache_hosts(_INVENTORY)  # `gpufleet sandbox up N --site-cache`: gpuhost1 (docs/site-cache.md)
