"""The package's layers (docs/architecture.md): every module imports, and no import runs back up.

Each top-level room of gpufleet has a level; a module may import from its own room and from rooms of a lower level,
never from a room of the same or a higher level. That one rule keeps, among others, facts and operations off the
network client (health), the health checks off the inventory, the ledger and the lock off the operations, the
inventory off the router and the offline lint off health; and it rules out import cycles between rooms. Imports
inside functions and under TYPE_CHECKING count like any other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import gpufleet

PACKAGE = Path(gpufleet.__file__).parent

# Lowest first. Rooms of one level never import each other. A slice (one service: settings, spec, unit, facts,
# operations, deploy) is not one room: each of its modules is a room of its own, placed with the shared rooms of
# its kind, so the vLLM slice's spec sits low (the wire rules and health read it) and its deploy high.
SLICES = ("vllm", "router", "sitecache")
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("quoting", "defaults", "image_names", "names", "data", "wheel_lock", "vllm.flags", "vllm.profiles", "vllm.group"),
    ("vllm.spec", "vllm.value_rules", "vllm.weights", "units"),
    (
        "wire",
        "vllm.unit",
        "vllm.plain_settings",
        "vllm.serve_args",
        "vllm.container_env",
        "vllm.docker_options",
        "router.spec",
    ),  # wire: pure rules over what vLLM and hosts send
    # remote: SSH through pyinfra's connector, the transport
    ("vllm.settings", "vllm.lint", "remote", "router.unit", "router.wheels", "sitecache.mirror"),
    ("router.settings", "vllm.lint_report", "vllm.group_specs", "hoststate", "hostlock", "facts", "sitecache.facts"),
    ("vllm.host_command",),  # the host snapshot's one command (it holds the ledger reader's lines)
    ("vllm.layout", "vllm.facts", "router.facts", "router.relock"),
    ("operations",),  # shared: base, files, secret, the run's state (run: one context per pyinfra run)
    ("sitecache.operations", "vllm.snapshot"),
    ("vllm.operations", "router.operations"),
    ("health",),  # the network client: checks, waits, answers, the probe
    ("inventory",),
    # harness: what every deploy file runs in: preflight, the run's result, the speedups
    ("harness", "vllm.host_specs", "vllm.service_watch"),
    ("sitecache.deploy", "vllm.checks", "vllm.commit", "vllm.host_read"),
    ("vllm.verify",),  # decides; vllm.commit writes the verdict to the host
    ("vllm.group_verify", "vllm.group_deploy"),  # a replica group's ranks: the head's verdict, the deploy's part
    ("vllm.deploy", "router.api"),
    ("router.status", "router.workers"),
    ("router.check", "router.deploy"),
    ("rollout",),
    ("sandbox",),
    ("cli",),
    ("__main__",),
)
LEVEL = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def modules() -> list[str]:
    return ["gpufleet"] + [m.name for m in pkgutil.walk_packages([str(PACKAGE)], "gpufleet.")]


def room(module: str) -> str:
    """gpufleet.health.check -> "health"; in a slice, gpufleet.vllm.operations.image -> "vllm.operations" (the
    package itself, gpufleet.vllm, is no room: it holds a docstring only)."""
    parts = module.split(".")
    if len(parts) < 2:
        return ""
    if parts[1] in SLICES:
        return f"{parts[1]}.{parts[2]}" if len(parts) > 2 else ""
    return parts[1]


def source(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported(module: str) -> list[tuple[str, int]]:
    """(gpufleet module imported, line) for every import in the module's source, relative ones resolved; `from
    gpufleet.x import y` names the submodule gpufleet.x.y when there is one."""
    path = source(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(
                    (sub if importlib.util.find_spec(sub.split(".")[0]) and _is_module(sub) else base, node.lineno)
                )
    return [(name, line) for name, line in found if name == "gpufleet" or name.startswith("gpufleet.")]


def _is_module(name: str) -> bool:
    if not name.startswith("gpufleet."):
        return False
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return path.is_dir() or path.with_suffix(".py").is_file()


def test_every_room_has_a_rank():
    rooms = {room(m) for m in modules()} - {""}
    assert rooms - set(LEVEL) == set(), "a new room needs its place in LAYERS (and in docs/architecture.md)"
    assert set(LEVEL) - rooms <= {"data"}, "LAYERS names a room that is gone"


@pytest.mark.parametrize("module", [m for m in modules() if not m.endswith("__main__")])  # those run the CLI
def test_module_imports(module):
    importlib.import_module(module)


def test_no_import_runs_back_up_the_layers():
    broken = []
    for module in modules():
        here = room(module)
        for target, line in imported(module):
            there = room(target)
            if there == here or there == "" or here == "":
                continue  # within a room; the package's own __init__ (its version) sits below every room
            if LEVEL[there] >= LEVEL[here]:
                broken.append(
                    f"{source(module).relative_to(PACKAGE.parent)}:{line}: {module} imports {target} "
                    f"({here} is level {LEVEL[here]}, {there} level {LEVEL[there]})"
                )
    assert broken == [], "\n".join(broken)


def test_the_rule_is_checked_against_real_imports():
    # The reader finds imports the rule is about (so the test above cannot pass by reading nothing).
    found = dict(imported("gpufleet.health.check"))
    assert "gpufleet.wire.identity" in found and "gpufleet.remote.transport" in found
    assert "gpufleet.operations.run" in dict(imported("gpufleet.router.operations"))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("gpufleet.vllm.facts", "gpufleet.health"),
        ("gpufleet.vllm.operations.service", "gpufleet.health"),
        ("gpufleet.health.runner", "gpufleet.inventory"),
        ("gpufleet.hostlock", "gpufleet.operations"),
        ("gpufleet.inventory", "gpufleet.router"),
        ("gpufleet.vllm.lint", "gpufleet.health"),
    ],
)
def test_the_named_layer_rules(module, forbidden):
    assert not [t for t, _ in imported(module) if t == forbidden or t.startswith(forbidden + ".")]
    if room(forbidden):  # a whole slice (gpufleet.router) has rooms on several levels: the import check is the rule
        assert LEVEL[room(forbidden)] > LEVEL[room(module)]


def test_hosts_are_reached_only_through_remote():
    # SSH is opened in one place: nothing outside gpufleet.remote imports paramiko's client or pyinfra's connector.
    openers = []
    for module in modules():
        if room(module) in ("remote", "sandbox"):
            continue
        text = source(module).read_text()
        if "SSHClient(" in text or "pyinfra.connectors" in text:
            openers.append(module)
    assert openers == []


def package(module: str) -> str:
    """The top-level package (or module) of gpufleet a module belongs to, a slice whole: gpufleet.vllm.spec -> vllm."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle_between_packages():
    # Levels hold module by module; this holds the packages too, each slice taken whole: the shared base imports no
    # slice, and the slices import each other one way only (the router the vLLM settings, the vLLM pull the cache).
    graph: dict[str, set[str]] = {}
    for module in modules():
        here = package(module)
        for target, _ in imported(module):
            there = package(target)
            if here and there and there != here:
                graph.setdefault(here, set()).add(there)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif len(path) < len(graph) + 1:
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert cycles == [], "\n".join(sorted(set(cycles)))
    assert "vllm" in graph["router"] and not {"vllm", "router", "sitecache"} & graph.get("operations", set())
