"""pyinfra's per-operation-call bookkeeping at a fraction of its cost, with results equal to pyinfra's own.

Each speedup replaces a pyinfra function only where its source, and what the speedup relies on, is the one it was
checked against; any other pyinfra keeps its own. What each saves: docs/bench-history.md.
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

# sha256 of each replaced function's source in pyinfra 3.10.0.
KNOWN_SOURCES = {
    "pyinfra.api.util.get_operation_order_from_stack": "f4807f61585570e091fd453c7552d9e2b49329555f07f395a8e8f1d2a398a0b2",
    "pyinfra.api.arguments.all_global_arguments": "f7afbc472d78c5d2f0bb282994175647651e888543da001968d903cc4a26a5a1",
    "pyinfra.api.arguments.pop_global_arguments": "a12a311539ff5068152b1c9c4578d77a8a893239a570f912768050a623069faf",
}
# What else a speedup relies on, checked the same way.
RELIED_ON = {
    "pyinfra.api.arguments.pop_global_arguments": {
        "pyinfra.api.host.HostData.__init__": "e55c67621dac45d87a4319502a2cae8b46218cef075e23771f034780514a8095",
        "pyinfra.api.host.HostData.__getattr__": "87152f64f2a65e537473f169b0cfa4e0c39547ee4054d73bad6bbf97af313433",
        "pyinfra.api.host.extract_callable_datas": "5f05d834948d82be4917f1685050df712c459fe9ad4bb9f61ee05c041246b0d4",
    },
}
CHECKED_AGAINST = "3.10.0"
# pyinfra's and pyinfra_cli's frames, which the order leaves out.
PYINFRA_DIR: str = importlib.import_module("pyinfra.api.util").PYINFRA_INSTALL_DIR
# The modules that bound each function by name at import.
USERS = {
    "pyinfra.api.util.get_operation_order_from_stack": ("pyinfra.api.util", "pyinfra.api.operation"),
    "pyinfra.api.arguments.all_global_arguments": ("pyinfra.api.arguments", "pyinfra.api.facts"),
    "pyinfra.api.arguments.pop_global_arguments": (
        "pyinfra.api.arguments",
        "pyinfra.api.operation",
        "pyinfra.api.deploy",
        "pyinfra.api.facts",
    ),
}


def operation_order(state: State, frame: FrameType | None = None) -> list[int]:
    """pyinfra's get_operation_order_from_stack, walking f_back instead of building inspect.stack()."""
    frames: list[FrameType] = []
    current: FrameType | None = frame or sys._getframe(1)
    while current is not None:
        frames.append(current)
        current = current.f_back
    frames.reverse()

    start = 0
    if state.current_deploy_filename:
        # As pyinfra's: the deploy file's first frame, else the innermost one.
        start = next(
            (i for i, outer in enumerate(frames) if outer.f_code.co_filename == state.current_deploy_filename),
            max(len(frames) - 1, 0),
        )

    line_numbers = [state.current_op_file_number] if pyinfra.is_cli else []
    line_numbers.extend(f.f_lineno for f in frames[start:] if not f.f_code.co_filename.startswith(PYINFRA_DIR))
    return line_numbers


def _operation_order_from_caller(state: State) -> list[int]:
    return operation_order(state, sys._getframe(1))


def _cached_global_arguments(original: Callable[[], list[tuple[str, type]]]) -> Callable[[], list[tuple[str, type]]]:
    hints = functools.cache(original)

    def all_global_arguments() -> list[tuple[str, type]]:
        return list(hints())  # a fresh list, as pyinfra's: a caller may change it

    return all_global_arguments


class _HostForArguments:
    """What pop_global_arguments reads from a host."""

    __slots__ = ("current_deploy_kwargs", "data")

    def __init__(self, current_deploy_kwargs: Any, data: SimpleNamespace):
        self.current_deploy_kwargs, self.data = current_deploy_kwargs, data


def _data_resolved_once(original: Callable[..., Any]) -> Callable[..., Any]:
    def pop_global_arguments(state: State, host: Host, kwargs: dict[str, Any]) -> Any:
        data = host.data
        if type(data) is HostData:
            layers = [layer() if callable(layer) else layer for layer in data.datas]
            if all(type(layer) is dict for layer in layers):
                # As HostData.__getattr__: the first layer holding a key wins, as a shallow copy.
                found: dict[str, Any] = {}
                for layer in reversed(layers):
                    found.update((key, layer[key]) for key in _argument_names().intersection(layer))
                view = SimpleNamespace(**{key: copy.copy(value) for key, value in found.items()})
                return original(state, _HostForArguments(host.current_deploy_kwargs, view), kwargs)
        return original(state, host, kwargs)  # data only pyinfra's own lookup reads

    return pop_global_arguments


@functools.cache
def _argument_names() -> frozenset[str]:
    return frozenset(key for key, _ in importlib.import_module("pyinfra.api.arguments").all_global_arguments())


def install() -> list[str]:
    """Swap in the speedups whose pyinfra code is the one checked; the names of the functions replaced."""
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
        faster.__wrapped__ = original  # type: ignore[attr-defined]
        for user in USERS[name]:
            module = importlib.import_module(user)
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, faster)
        installed.append(name)
    return installed


def checked(name: str, original: Callable[..., Any]) -> bool:
    return _source_sha256(original) == KNOWN_SOURCES[name] and all(
        _source_sha256(_resolve(dotted)) == digest for dotted, digest in RELIED_ON.get(name, {}).items()
    )


def _resolve(dotted: str) -> Callable[..., Any]:
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


_REPORTED: set[str] = set()  # once per process, however many deploy files install


def install_and_say() -> list[str]:
    """install(), saying once per process what it did: a warning when some speedup does not apply."""
    installed = install()
    skipped = sorted(set(KNOWN_SOURCES) - set(installed))
    line = (
        f"pyinfra {pyinfra_version()} differs from the {CHECKED_AGAINST} gpufleet's speedups were checked against: "
        f"pyinfra's own {', '.join(name.rpartition('.')[2] for name in skipped)} run unchanged (slower, correct)"
        if skipped
        else f"pyinfra {pyinfra_version()}: gpufleet's faster operation bookkeeping is on "
        f"({len(installed)} functions, gpufleet.harness.speedups)"
    )
    if line not in _REPORTED:
        _REPORTED.add(line)
        (logger.warning if skipped else logger.info)(line)
    return installed


def pyinfra_version() -> str:
    try:
        return importlib.metadata.version("pyinfra")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


@functools.cache  # every host's deploy file calls install()
def _source_sha256(function: Callable[..., Any]) -> str | None:
    """sha256 of the function's lines up to the last its code runs, without inspect.getsource's slow tokenizer."""
    code = function.__code__
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    lines = linecache.getlines(code.co_filename)[code.co_firstlineno - 1 : last]
    if not lines:  # no source shipped: keep pyinfra's own
        return None
    return hashlib.sha256("".join(lines).encode()).hexdigest()
