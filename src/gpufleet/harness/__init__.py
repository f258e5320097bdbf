"""What every deploy file runs in: preflight, the run's result, pyinfra's speedups."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

from pyinfra.context import ctx_state

from gpufleet.harness import result, speedups

# The checkout's deploys/*.py, shipped so that the CLI needs no checkout; pyinfra runs them by path.
PACKAGED_DEPLOYS = Path(__file__).resolve().parent.parent / "data" / "deploys"


def packaged_deploy_file(name: str) -> Path:
    """The packaged deploy file `name`: "qwen35" or "router"."""
    return PACKAGED_DEPLOYS / f"{name}.py"


def register_deploy_file(path: str) -> None:
    """Install the speedups and the run's summary, and give the deploy file pyinfra exec()s a module entry.

    Without the entry, `inspect` rescans sys.modules for its frames on every operation call (docs/bench-history.md).
    """
    speedups.install_and_say()
    if ctx_state.isset():
        result.print_at_exit(ctx_state.get())
    absolute = os.path.abspath(path)
    name = f"gpufleet-deploy-file:{absolute}"  # not importable by accident
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__file__ = absolute
        sys.modules[name] = module
