"""What every deploy file runs in: register_deploy_file (here), preflight, the run's result, pyinfra's speedups."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from pyinfra.context import ctx_state

from gpufleet.harness import result, speedups

# The deploy entry points shipped in the package (the checkout's deploys/*.py, statement for statement): pyinfra
# executes them by path, so `gpufleet deploy` and `gpufleet rollout` need no checkout. Not importable modules.
PACKAGED_DEPLOYS = Path(__file__).resolve().parent.parent / "data" / "deploys"


def packaged_deploy_file(name: str) -> Path:
    """The installed package's deploy file `name` ("qwen35": the vLLM hosts, "router": the routers group)."""
    return PACKAGED_DEPLOYS / f"{name}.py"


def register_deploy_file(path: str) -> None:
    """Give a deploy file that pyinfra runs with exec() a module entry, so `inspect` can place its frames.

    pyinfra orders every operation call by walking the stack (pyinfra.api.util.get_operation_order_from_stack), and
    inspect maps each frame's file to its module: for a file no module claims it rescans all of sys.modules (some
    1,500 here), three times per operation call, on every host. With the entry, each lookup is a dict hit. Also
    installs the cheaper walk itself where this pyinfra's is the one it was checked against (gpufleet.harness.speedups);
    the entry keeps pyinfra's own walk affordable where it is not. And it makes the run's last lines name every host
    that failed or could not be reached, with the fix (gpufleet.harness.result).
    """
    speedups.install_and_say()
    if ctx_state.isset():
        result.print_at_exit(ctx_state.get())
    absolute = os.path.abspath(path)
    name = f"gpufleet-deploy-file:{absolute}"  # not an importable name: nothing can import it by accident
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__file__ = absolute
        sys.modules[name] = module
