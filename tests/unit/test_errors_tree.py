"""errors.py draws the GpufleetError tree in its docstring; this keeps the drawing and the classes in step."""

from __future__ import annotations

import importlib
import pkgutil
import re

import gpufleet
from gpufleet import errors
from gpufleet.errors import GpufleetError

# "  * HostLockBusy (hostlock): another run holds the host": indent, name, module under gpufleet.
DRAWN_LINE = re.compile(r"^(?P<indent> *)\* (?P<name>\w+) \((?P<module>[\w.]+)\)")


def drawn_tree() -> dict[tuple[str, str], tuple[str, str] | None]:
    """(module, name) of each drawn class -> (module, name) of the class drawn above it, one level up."""
    tree: dict[tuple[str, str], tuple[str, str] | None] = {}
    parents: list[tuple[str, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        if not (match := DRAWN_LINE.match(line)):
            continue
        depth = len(match["indent"]) // 2
        node = (f"gpufleet.{match['module']}", match["name"])
        del parents[depth:]
        tree[node] = parents[-1] if parents else None
        parents.append(node)
    return tree


def real_tree() -> dict[tuple[str, str], tuple[str, str] | None]:
    for module in pkgutil.walk_packages(gpufleet.__path__, "gpufleet."):
        if not module.name.endswith("__main__"):  # it runs the CLI
            importlib.import_module(module.name)
    tree: dict[tuple[str, str], tuple[str, str] | None] = {(GpufleetError.__module__, GpufleetError.__name__): None}
    todo = [GpufleetError]
    while todo:
        parent = todo.pop()
        for cls in parent.__subclasses__():
            tree[(cls.__module__, cls.__name__)] = (parent.__module__, parent.__name__)
            todo.append(cls)
    return tree


def test_the_drawn_tree_is_every_gpufleet_error_under_its_own_base():
    drawn, real = drawn_tree(), real_tree()
    assert len(drawn) > 1, "errors.py's docstring draws no tree"
    assert set(real) - set(drawn) == set(), "draw these in errors.py's docstring"
    assert set(drawn) - set(real) == set(), "errors.py draws classes that are gone or moved"
    assert drawn == real, "a class is drawn under another base than its own"
