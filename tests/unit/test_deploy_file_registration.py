"""register_deploy_file: a deploy file run with exec() (as pyinfra runs it) becomes a file inspect can place."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from gpufleet.harness import register_deploy_file


def frame_of_file(path: Path):
    """The frame of code compiled from `path` and run with exec(), as pyinfra_cli.util.exec_file does."""
    code = compile("import sys\nframe = sys._getframe()\n", str(path), "exec")
    scope: dict = {"__file__": str(path)}
    exec(code, scope)
    return scope["frame"]


def test_exec_file_is_found_by_inspect_once_registered(tmp_path: Path) -> None:
    path = tmp_path / "deploy.py"
    path.write_text("import sys\nframe = sys._getframe()\n")
    frame = frame_of_file(path)
    assert inspect.getmodule(frame, str(path)) is None  # the slow path: every module scanned, nothing found

    register_deploy_file(str(path))
    module = inspect.getmodule(frame, str(path))
    assert module is not None and module.__file__ == str(path.resolve())
    register_deploy_file(str(path))  # a second host's exec of the same file: still one entry
    assert sum(1 for name in sys.modules if name.endswith(str(path.resolve()))) == 1
