"""pyinfra's per-operation-call bookkeeping at a fraction of its cost, with results equal to pyinfra's own.

Every operation call in a CLI run (17 per host in the Qwen 3.5 deploy) costs pyinfra, before the operation itself:
- ordering: `pyinfra.api.util.get_operation_order_from_stack` builds `inspect.stack()` (every frame's file, module
  and source line, read from disk) and then calls `inspect.getframeinfo` again on each frame, to keep only two
  things per frame: its file name and its line number. Walking `frame.f_back` gives both directly.
- arguments: `pyinfra.api.arguments.all_global_arguments` resolves the type hints of the `AllArguments` TypedDict
  (`typing.get_type_hints`, ~30 keys through three base classes) on every call; the class never changes.
- argument defaults: `pyinfra.api.arguments.pop_global_arguments` looks each of its 32 arguments up in `host.data`,
  and every lookup resolves the host's five data layers again (merging all its groups' data into a new dict each
  time) before the argument is, almost always, not found. The speedup resolves the layers once per call and hands
  pyinfra's own function a view of them; the function itself is pyinfra's, unchanged.

Measured on an 8-host no-op converge (2 cores, 8 nspawn hosts): controller CPU 0.77 -> 0.62 s, wall 1.24 -> 1.06 s
(medians of 7, interleaved) for the first two; the third: pop_global_arguments 124-155 -> 21-29 us a call (a host
with data in five layers), 144 calls in that run. All three belong upstream; until pyinfra ships them, install()
swaps them in, but only over the exact code they were checked against (the sha256 of each function's source): any
other pyinfra keeps its own, slower and still correct. tests/unit/test_harness_speedups.py checks the walk gives
pyinfra's own order on nested deploys, loops and multi-line calls, the argument defaults equal pyinfra's (every data
layer, a deploy's kwargs and data, copies, type errors), and that the installed pyinfra gets the speedups.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib
import importlib.metadata
import linecache
import sys
from collections.abc import Callable
from types import FrameType, SimpleNamespace
from typing import Any

import pyinfra
from pyinfra import logger
from pyinfra.api.host import Host, HostData
from pyinfra.api.state import State

# sha256 of the source of the functions replaced (_source_sha256), as pyinfra 3.10.0 ships them.
KNOWN_SOURCES = {
    "pyinfra.api.util.get_operation_order_from_stack":
        "f4807f61585570e091fd453c7552d9e2b49329555f07f395a8e8f1d2a398a0b2",
    "pyinfra.api.arguments.all_global_arguments":
        "f7afbc472d78c5d2f0bb282994175647651e888543da001968d903cc4a26a5a1",
    "pyinfra.api.arguments.pop_global_arguments":
        "a12a311539ff5068152b1c9c4578d77a8a893239a570f912768050a623069faf",
}
# What else each speedup relies on, checked the same way: the data-layer lookup the argument defaults re-implement
# (HostData's layers, as its constructor stacks them, read first to last, callables called, each value copied).
RELIED_ON = {
    "pyinfra.api.arguments.pop_global_arguments": {
        "pyinfra.api.host.HostData.__init__": "e55c67621dac45d87a4319502a2cae8b46218cef075e23771f034780514a8095",
        "pyinfra.api.host.HostData.__getattr__": "87152f64f2a65e537473f169b0cfa4e0c39547ee4054d73bad6bbf97af313433",
        "pyinfra.api.host.extract_callable_datas": "5f05d834948d82be4917f1685050df712c459fe9ad4bb9f61ee05c041246b0d4",
    },
}
CHECKED_AGAINST = "3.10.0"  # the pyinfra whose sources the sums above are of
# pyinfra's own frames (pyinfra_cli's too: the same prefix), left out of the order as pyinfra leaves them out.
PYINFRA_DIR: str = importlib.import_module("pyinfra.api.util").PYINFRA_INSTALL_DIR
# The modules that bound each function by name at import (`from .util import get_operation_order_from_stack`).
USERS = {
    "pyinfra.api.util.get_operation_order_from_stack": ("pyinfra.api.util", "pyinfra.api.operation"),
    "pyinfra.api.arguments.all_global_arguments": ("pyinfra.api.arguments", "pyinfra.api.facts"),
    "pyinfra.api.arguments.pop_global_arguments": ("pyinfra.api.arguments", "pyinfra.api.operation",
                                                   "pyinfra.api.deploy", "pyinfra.api.facts"),
}


def operation_order(state: State, frame: FrameType | None = None) -> list[int]:
    """pyinfra's get_operation_order_from_stack from the frames themselves: the line numbers of the calls from the
    outermost frame of the deploy file being run inward, pyinfra's own frames left out, after the deploy file's
    position among the files it runs (CLI mode). frame: where the walk starts (default: the caller's)."""
    frames: list[FrameType] = []
    current: FrameType | None = frame or sys._getframe(1)
    while current is not None:
        frames.append(current)
        current = current.f_back
    frames.reverse()

    start = 0
    if state.current_deploy_filename:
        # As pyinfra's: the first frame of the deploy file, else (no such frame) the innermost one.
        start = next((i for i, outer in enumerate(frames) if outer.f_code.co_filename == state.current_deploy_filename),
                     max(len(frames) - 1, 0))

    line_numbers = [state.current_op_file_number] if pyinfra.is_cli else []
    line_numbers.extend(f.f_lineno for f in frames[start:] if not f.f_code.co_filename.startswith(PYINFRA_DIR))
    return line_numbers


def _operation_order_from_caller(state: State) -> list[int]:
    return operation_order(state, sys._getframe(1))


def _cached_global_arguments(original: Callable[[], list[tuple[str, type]]]) -> Callable[[], list[tuple[str, type]]]:
    hints = functools.cache(original)

    def all_global_arguments() -> list[tuple[str, type]]:
        return list(hints())  # a fresh list each call, as pyinfra's: a caller may change it

    return all_global_arguments


class _HostForArguments:
    """The two things pop_global_arguments reads from a host (its source is checked: KNOWN_SOURCES)."""

    __slots__ = ("current_deploy_kwargs", "data")

    def __init__(self, current_deploy_kwargs: Any, data: SimpleNamespace):
        self.current_deploy_kwargs, self.data = current_deploy_kwargs, data


def _data_resolved_once(original: Callable[..., Any]) -> Callable[..., Any]:
    def pop_global_arguments(state: State, host: Host, kwargs: dict[str, Any]) -> Any:
        data = host.data
        if type(data) is HostData:
            layers = [layer() if callable(layer) else layer for layer in data.datas]  # as extract_callable_datas
            if all(type(layer) is dict for layer in layers):
                # What HostData.__getattr__ would answer for each argument: the first layer holding it wins, and
                # gives a shallow copy. A missing one raises AttributeError, as there.
                found: dict[str, Any] = {}
                for layer in reversed(layers):
                    found.update((key, layer[key]) for key in _argument_names().intersection(layer))
                view = SimpleNamespace(**{key: copy.copy(value) for key, value in found.items()})
                return original(state, _HostForArguments(host.current_deploy_kwargs, view), kwargs)
        return original(state, host, kwargs)  # data only pyinfra's own lookup knows how to read

    return pop_global_arguments


@functools.cache
def _argument_names() -> frozenset[str]:
    """The arguments pop_global_arguments looks up in host.data (its loop: all_global_arguments())."""
    return frozenset(key for key, _ in importlib.import_module("pyinfra.api.arguments").all_global_arguments())


def install() -> list[str]:
    """Swap the speedups in where pyinfra's functions are the ones they were checked against; idempotent.
    Returns the names of the functions now replaced (empty when this pyinfra differs)."""
    replacements: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
        "pyinfra.api.util.get_operation_order_from_stack": lambda _original: _operation_order_from_caller,
        "pyinfra.api.arguments.all_global_arguments": _cached_global_arguments,
        "pyinfra.api.arguments.pop_global_arguments": _data_resolved_once,
    }
    installed = []
    for name, replace in replacements.items():
        module_name, _, attribute = name.rpartition(".")
        original = getattr(importlib.import_module(module_name), attribute)
        if getattr(original, "_gpufleet_speedup", False):
            installed.append(name)
            continue
        if not checked(name, original):
            continue
        faster = replace(original)
        faster._gpufleet_speedup = True  # type: ignore[attr-defined]
        faster.__wrapped__ = original  # type: ignore[attr-defined]  # pyinfra's own, for tests and debugging
        for user in USERS[name]:
            module = importlib.import_module(user)
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, faster)
        installed.append(name)
    return installed


def checked(name: str, original: Callable[..., Any]) -> bool:
    """Is pyinfra's function, and everything its speedup relies on, the code the speedup was checked against?"""
    return _source_sha256(original) == KNOWN_SOURCES[name] and all(
        _source_sha256(_resolve(dotted)) == digest for dotted, digest in RELIED_ON.get(name, {}).items())


def _resolve(dotted: str) -> Callable[..., Any]:
    """A function by its dotted name: module, then attributes (a class's method included)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


_REPORTED: set[str] = set()  # said once per process, however many deploy files install


def install_and_say() -> list[str]:
    """install(), saying once per process what it did: one info line when every speedup applies, one warning
    naming this pyinfra and what runs unchanged when some do not (pyinfra's own code: slower, still correct)."""
    installed = install()
    skipped = sorted(set(KNOWN_SOURCES) - set(installed))
    line = (f"pyinfra {pyinfra_version()} differs from the {CHECKED_AGAINST} gpufleet's speedups were checked against: "
            f"pyinfra's own {', '.join(name.rpartition('.')[2] for name in skipped)} run unchanged (slower, correct)"
            if skipped else
            f"pyinfra {pyinfra_version()}: gpufleet's faster operation bookkeeping is on "
            f"({len(installed)} functions, gpufleet.harness.speedups)")
    if line not in _REPORTED:
        _REPORTED.add(line)
        (logger.warning if skipped else logger.info)(line)
    return installed


def pyinfra_version() -> str:
    try:
        return importlib.metadata.version("pyinfra")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


@functools.cache  # every host's deploy file calls install(): read each source once per run
def _source_sha256(function: Callable[..., Any]) -> str | None:
    """sha256 of the function's source lines, from its first line to the last one its code runs (the lines
    inspect.getsource would give, less trailing comments; without its tokenizer, which costs ~5 ms a run)."""
    code = function.__code__
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    lines = linecache.getlines(code.co_filename)[code.co_firstlineno - 1:last]
    if not lines:  # no source shipped (a zipped or compiled-only install): keep pyinfra's own
        return None
    return hashlib.sha256("".join(lines).encode()).hexdigest()
