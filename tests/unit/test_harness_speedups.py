"""gpufleet.harness.speedups: the cheaper operation ordering and argument hints give exactly what pyinfra's own give."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyinfra
import pytest

from gpufleet.harness import speedups

util = importlib.import_module("pyinfra.api.util")
arguments = importlib.import_module("pyinfra.api.arguments")

# A deploy file as people write them: operations called from nested functions, in a loop, across several lines.
DEPLOY = """\
def inner(i):
    return probe(
        i,
    )


def outer():
    found = []
    for i in range(2):
        found.append(
            inner(i))
    return found


FOUND = outer()
FOUND.append(probe(99))
"""


@pytest.fixture
def pyinfra_functions() -> Iterator[None]:
    """pyinfra's own functions for the test (an earlier test in this process may have installed the speedups),
    and every binding put back as it was after it."""
    saved = {
        (user, name.rpartition(".")[2]): getattr(importlib.import_module(user), name.rpartition(".")[2])
        for name, users in speedups.USERS.items()
        for user in users
    }
    for (user, attribute), value in saved.items():
        setattr(importlib.import_module(user), attribute, getattr(value, "__wrapped__", value))
    yield
    for (user, attribute), value in saved.items():
        setattr(importlib.import_module(user), attribute, value)


def pyinfras_own(name: str) -> Any:
    module_name, _, attribute = name.rpartition(".")
    current = getattr(importlib.import_module(module_name), attribute)
    return getattr(current, "__wrapped__", current)


# What stands between a deploy file and the walk: pyinfra's operation machinery, whose frames (in pyinfra's own
# directory) neither walk counts. Compiled under a file name in that directory, as pyinfra's own code is.
PYINFRA_CALLER = """\
def probe(_):
    return original(state), ours(state)
"""


def run_deploy_file(path: Path, state: Any) -> list[tuple[list[int], list[int]]]:
    """Exec the file as pyinfra_cli.util.exec_file does; each probe() call returns (pyinfra's order, ours)."""
    machinery: dict[str, Any] = {
        "original": pyinfras_own("pyinfra.api.util.get_operation_order_from_stack"),
        "ours": speedups._operation_order_from_caller,
        "state": state,
    }
    exec(compile(PYINFRA_CALLER, f"{speedups.PYINFRA_DIR}/api/operation_machinery.py", "exec"), machinery)
    scope: dict[str, Any] = {"probe": machinery["probe"]}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope["FOUND"]


@pytest.mark.parametrize("deploy_file_in_stack", [True, False])
@pytest.mark.parametrize("cli", [True, False])
def test_operation_order_is_pyinfras_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deploy_file_in_stack: bool, cli: bool
) -> None:
    path = tmp_path / "deploy.py"
    path.write_text(DEPLOY)
    monkeypatch.setattr(pyinfra, "is_cli", cli)
    state = SimpleNamespace(
        current_deploy_filename=str(path) if deploy_file_in_stack else str(tmp_path / "other.py"),
        current_op_file_number=3,
    )
    found = run_deploy_file(path, state)
    assert len(found) == 3
    for theirs, ours in found:
        assert ours == theirs
    if deploy_file_in_stack:
        # The lines of the calls in the deploy file, outermost first, after the file's number in CLI mode (a loop's
        # calls share their lines: pyinfra tells them apart by loop position and its duplicate counter).
        file_number = [3] if cli else []
        assert [ours for _, ours in found] == [file_number + [15, 11, 2]] * 2 + [file_number + [16]]


def test_operation_order_without_a_deploy_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "deploy.py"
    path.write_text(DEPLOY)
    monkeypatch.setattr(pyinfra, "is_cli", True)
    state = SimpleNamespace(current_deploy_filename=None, current_op_file_number=0)
    for theirs, ours in run_deploy_file(path, state):
        assert ours == theirs


def test_global_arguments_are_pyinfras_own_and_a_fresh_list() -> None:
    original = pyinfras_own("pyinfra.api.arguments.all_global_arguments")
    cached = speedups._cached_global_arguments(original)
    first = cached()
    assert first == original() and len(first) > 10
    first.clear()
    assert cached() == original()


def a_host(host_data: dict[str, Any], group_data: dict[str, Any], fleet_data: dict[str, Any]) -> tuple[Any, Any]:
    """A real pyinfra state and host with data in every layer: host, two groups, the inventory's, overrides."""
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory(
        ([("gpu1", host_data)], fleet_data),
        gpus=([("gpu1", {})], group_data),
        lab=(["gpu1"], {"_chdir": "/srv", "name": "from the lab group"}),
    )
    state = State(inventory, Config())
    return state, inventory.get_host("gpu1")


def pop_both(state: Any, host: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(pyinfra's result, ours) for the same call; each gets its own copy of kwargs, and what each left in it."""
    original = pyinfras_own("pyinfra.api.arguments.pop_global_arguments")
    ours = speedups._data_resolved_once(original)
    theirs_kwargs, our_kwargs = dict(kwargs), dict(kwargs)
    return (original(state, host, theirs_kwargs), theirs_kwargs), (ours(state, host, our_kwargs), our_kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"name": "Install", "_sudo": False, "packages": ["curl"]},
        {"_env": {"A": "1"}, "_timeout": 9, "_if": [], "other": 1},
    ],
)
def test_global_argument_defaults_are_pyinfras_own(kwargs: dict[str, Any]) -> None:
    state, host = a_host(
        {"_sudo": True, "_env": {"HOST": "1"}, "ssh_user": "deploy"},
        {"_timeout": 5, "_sudo_user": "svc", "_env": {"GROUP": "1"}},
        {"_retries": 2},
    )
    host.data._shell_executable = "bash"  # an override set during the deploy: the first layer
    theirs, ours = pop_both(state, host, kwargs)
    assert ours == theirs
    arguments_found = ours[0][0]
    assert (arguments_found["_sudo_user"], arguments_found["_retries"], arguments_found["_shell_executable"]) == (
        "svc",
        2,
        "bash",
    )


def test_global_argument_defaults_inside_a_deploy_use_its_kwargs_and_data() -> None:
    state, host = a_host({"_sudo": True}, {}, {})
    with inside_deploy(host, kwargs={"_sudo": False, "_if": []}, data={"_timeout": 30, "_retries": 1}):
        theirs, ours = pop_both(state, host, {"name": "x"})
    assert ours == theirs and ours[0][0]["_sudo"] is False and ours[0][0]["_timeout"] == 30


@contextlib.contextmanager
def inside_deploy(host: Any, kwargs: dict[str, Any], data: dict[str, Any]) -> Iterator[None]:
    """The host as pyinfra's @deploy leaves it for the operations it calls (Host.deploy)."""
    host.current_deploy_kwargs, host.current_deploy_data = kwargs, data
    try:
        yield
    finally:
        host.current_deploy_kwargs = host.current_deploy_data = None


def test_global_argument_defaults_are_copies_as_pyinfras() -> None:
    state, host = a_host({"_env": {"HOST": "1"}, "_success_exit_codes": [0, 3]}, {}, {})
    ours = speedups._data_resolved_once(pyinfras_own("pyinfra.api.arguments.pop_global_arguments"))
    found, _ = ours(state, host, {})
    found["_success_exit_codes"].append(99)
    assert host.data._success_exit_codes == [0, 3]


def test_a_bad_global_argument_type_is_refused_as_pyinfra_refuses_it() -> None:
    from pyinfra.api.exceptions import ArgumentTypeError

    state, host = a_host({}, {}, {})
    original = pyinfras_own("pyinfra.api.arguments.pop_global_arguments")
    ours = speedups._data_resolved_once(original)
    with pytest.raises(ArgumentTypeError) as theirs:
        original(state, host, {"_timeout": "soon"})
    with pytest.raises(ArgumentTypeError) as our_error:
        ours(state, host, {"_timeout": "soon"})
    assert str(our_error.value) == str(theirs.value)


def test_data_pyinfras_lookup_must_read_goes_to_pyinfra(monkeypatch: pytest.MonkeyPatch) -> None:
    class Layer:  # a mapping-like layer that is not a dict: only HostData's own try/except reads it right
        def __getitem__(self, key: str) -> Any:
            if key == "_timeout":
                return 7
            raise KeyError(key)

    state, host = a_host({}, {}, {})
    monkeypatch.setitem(host.data.__dict__, "datas", (*host.data.datas, Layer()))
    theirs, ours = pop_both(state, host, {})
    assert ours == theirs and ours[0][0]["_timeout"] == 7


def test_install_replaces_the_checked_functions_everywhere_they_are_bound(pyinfra_functions: None) -> None:
    installed = speedups.install()
    # The pyinfra this project pins is the one the speedups were checked against: if this fails after a pyinfra
    # upgrade, compare the new source with the walk above, then record its sha256 in KNOWN_SOURCES.
    assert installed == list(speedups.KNOWN_SOURCES)
    for name, users in speedups.USERS.items():
        attribute = name.rpartition(".")[2]
        for user in users:
            assert getattr(importlib.import_module(user), attribute)._gpufleet_speedup
    assert speedups.install() == installed  # every host's deploy file calls it: the second is a no-op
    assert importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack.__wrapped__ is pyinfras_own(
        "pyinfra.api.util.get_operation_order_from_stack"
    )


def test_install_leaves_a_different_pyinfra_alone(pyinfra_functions: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(speedups.KNOWN_SOURCES, "pyinfra.api.util.get_operation_order_from_stack", "0" * 64)
    before = util.get_operation_order_from_stack
    installed = speedups.install()
    assert "pyinfra.api.util.get_operation_order_from_stack" not in installed
    assert util.get_operation_order_from_stack is before
    assert not hasattr(
        importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack, "_gpufleet_speedup"
    )


def test_frames_of_this_test_are_counted_like_pyinfras(monkeypatch: pytest.MonkeyPatch) -> None:
    # No deploy file, walked from here: every frame outside pyinfra's directory counts, pytest's included.
    monkeypatch.setattr(pyinfra, "is_cli", False)
    state = SimpleNamespace(current_deploy_filename=None, current_op_file_number=0)
    original = pyinfras_own("pyinfra.api.util.get_operation_order_from_stack")
    assert speedups.operation_order(state, sys._getframe()) == original(state)


# Operations called in an order only the stack walk gets right (by line alone `second` would come last); each runs
# `true` on this machine.
ORDERED_DEPLOY = """\
import os

from pyinfra.operations import server

from gpufleet.harness import speedups

if os.environ.get("SPEEDUPS"):
    assert speedups.install(), "the speedups must be active in this run"


def second(n):
    server.shell(name=f"second {n}", commands=["true"])


def first():
    server.shell(name="first", commands=["true"])
    for n in range(2):
        second(n)
    server.shell(name="third", commands=["true"])


first()
server.shell(name="fourth", commands=["true"])
"""


def test_a_real_pyinfra_run_orders_operations_the_same(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.py"
    deploy.write_text(ORDERED_DEPLOY)

    def operations(with_speedups: bool) -> list[str]:
        env = {**os.environ, "SPEEDUPS": "1" if with_speedups else ""}
        proc = subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", "@local", str(deploy)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [
            line.split("Starting operation:", 1)[1].strip()
            for line in (proc.stdout + proc.stderr).splitlines()
            if "Starting operation:" in line
        ]

    assert (
        operations(with_speedups=False)
        == operations(with_speedups=True)
        == ["first", "second 0", "second 1", "third", "fourth"]
    )


def test_the_guard_covers_what_the_argument_defaults_rely_on(monkeypatch):
    name = "pyinfra.api.arguments.pop_global_arguments"
    original = importlib.import_module("pyinfra.api.arguments").pop_global_arguments
    original = getattr(original, "__wrapped__", original)  # pyinfra's own, under the speedup if installed
    assert speedups.checked(name, original)
    # pyinfra's host data lookup changed under an unchanged pop_global_arguments: the speedup no longer applies.
    changed = {**speedups.RELIED_ON[name], "pyinfra.api.host.HostData.__getattr__": "0" * 64}
    monkeypatch.setitem(speedups.RELIED_ON, name, changed)
    assert not speedups.checked(name, original)


def test_what_install_did_is_said_once_an_info_line_or_a_warning_naming_pyinfra(monkeypatch, caplog):
    monkeypatch.setattr(speedups, "_REPORTED", set())
    with caplog.at_level("INFO", logger="pyinfra"):
        speedups.install_and_say()
        speedups.install_and_say()
    [applied] = [r for r in caplog.records if "speedups" in r.getMessage() or "bookkeeping" in r.getMessage()]
    assert applied.levelname == "INFO" and "faster operation bookkeeping is on (3 functions" in applied.getMessage()
    caplog.clear()
    monkeypatch.setattr(speedups, "install", lambda: ["pyinfra.api.util.get_operation_order_from_stack"])
    monkeypatch.setattr(speedups, "pyinfra_version", lambda: "3.99.0")
    with caplog.at_level("INFO", logger="pyinfra"):
        speedups.install_and_say()
    [skipped] = caplog.records
    assert skipped.levelname == "WARNING"
    assert skipped.getMessage() == (
        "pyinfra 3.99.0 differs from the 3.10.0 gpufleet's speedups were checked against: "
        "pyinfra's own all_global_arguments, pop_global_arguments run unchanged (slower, "
        "correct)"
    )
