"""A lock of every wheel a host installs for one Python component, by sha256 (docs/router.md, "The lock")."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpufleet.errors import SettingError

INDEX_URL = "https://pypi.org/simple"
# Debian bookworm's, Ubuntu 24.04's, Debian trixie's.
PYTHONS = ("3.11", "3.12", "3.13")
MACHINES = ("x86_64", "aarch64")
# Debian bookworm's glibc 2.36: no wheel for a newer one is locked.
GLIBC_MINOR = 36
_NAME = re.compile(r"[-_.]+")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def normalise(name: str) -> str:
    """The PEP 503 project name."""
    return _NAME.sub("-", name).lower()


@dataclass(frozen=True)
class Wheel:
    name: str  # PEP 503 normalised
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class LockFile:
    """One component's lock, and what its errors name."""

    package: str
    path: Path
    shown: str  # the path as the errors name it
    regenerate: str  # the command, e.g. "python -m gpufleet.router.relock"
    setting: str  # the package version's setting
    doc: str  # the docs page on regenerating it


@dataclass(frozen=True)
class LockedInstall:
    """The lock's wheels for one package version, Python and machine."""

    version: str
    python: str  # "3.11"
    machine: str
    wheels: tuple[Wheel, ...]
    package: str = ""
    shown: str = ""  # LockFile.shown

    def requirements(self) -> str:
        """The pip requirements file, in pip's hash-checking mode."""
        head = (
            f"# {self.package} {self.version} for CPython {self.python} on {self.machine}: every wheel gpufleet "
            f"installs, pinned by sha256 ({self.shown}).\n"
            "# pip install --require-hashes --only-binary :all: --no-deps -r <this file>\n"
        )
        return head + "".join(f"{w.name}=={w.version} --hash=sha256:{w.sha256}\n" for w in self.wheels)

    @property
    def key(self) -> str:
        """sha256 of the requirements, naming the venv that holds exactly these wheels."""
        return hashlib.sha256(self.requirements().encode()).hexdigest()

    def describe(self) -> str:
        return f"{self.package} {self.version} (lock {self.key[:12]}, Python {self.python}, {self.machine})"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def releases(lock: Mapping[str, Any]) -> list[str]:
    return sorted(lock["releases"])


def locked_install(
    of: LockFile,
    host: str,
    version: str,
    python: str | None,
    machine: str | None,
    lock: Mapping[str, Any] | None = None,
) -> LockedInstall:
    """The lock's wheels for a host; SettingError when it has none."""
    lock = lock if lock is not None else load(of.path)
    release = lock["releases"].get(version)
    if release is None:
        raise SettingError(
            host,
            of.setting,
            f"{version} is not in gpufleet's lock of {of.package} wheels ({of.shown} has {', '.join(releases(lock))})",
            f"choose a locked version, or lock it: {of.regenerate} --version {version}",
        )
    if not python:
        raise SettingError(
            host,
            of.setting,
            "cannot tell which Python the host runs (no python3, and apt names no candidate for it)",
            "apt-get install python3 on it, then re-run",
        )
    entry = release.get(python, {}).get(machine or "")
    if entry is None:
        covered = ", ".join(f"{p} on {'/'.join(sorted(release[p]))}" for p in sorted(release))
        raise SettingError(
            host,
            of.setting,
            f"the lock of {of.package} {version} has no wheels for the host's "
            f"Python {python} on {machine} (it covers {covered})",
            f"lock them: {of.regenerate} --version {version} --python {python} --machine {machine}, "
            "and commit the lock",
        )
    return LockedInstall(version, python, str(machine), tuple(Wheel(**w) for w in entry), of.package, of.shown)


def check(package: str, lock: Mapping[str, Any]) -> list[str]:
    """Problems with a lock's shape, for the tests to hold the committed lock to."""
    problems = []
    for version, release in lock.get("releases", {}).items():
        for python, machines in release.items():
            for machine, wheels in machines.items():
                where = f"{version}/{python}/{machine}"
                names = [w.get("name") for w in wheels]
                if normalise(package) not in names:
                    problems.append(f"{where}: no {package}")
                if len(set(names)) != len(names):
                    problems.append(f"{where}: a project locked twice")
                for w in wheels:
                    if not (w.get("filename", "").endswith(".whl") and _HEX64.fullmatch(w.get("sha256", ""))):
                        problems.append(f"{where}: {w.get('filename')}: not a wheel with a sha256")
                    elif (
                        normalise(w["filename"].split("-")[0]) != w["name"]
                        or w["filename"].split("-")[1] != w["version"]
                    ):
                        problems.append(f"{where}: {w['filename']} is not {w['name']} {w['version']}")
    return problems


def platforms(machine: str) -> list[str]:
    """pip --platform tags a router host accepts, newest first."""
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(GLIBC_MINOR, 16, -1)]
    tags.append(f"manylinux2014_{machine}")
    if machine in ("x86_64", "i686"):
        tags += [f"manylinux_2_{minor}_{machine}" for minor in (12, 5)] + [
            f"manylinux2010_{machine}",
            f"manylinux1_{machine}",
        ]
    return tags


def pip_env() -> dict[str, str]:
    """The environment without this machine's pip settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def download(package: str, version: str, python: str, machine: str, dest: Path, index_url: str = INDEX_URL) -> None:
    """pip's own resolution of package==version for that Python and machine, wheels only."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--index-url",
        index_url,
        "--dest",
        str(dest),
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        *[a for tag in platforms(machine) for a in ("--platform", tag)],
        f"{package}=={version}",
    ]
    subprocess.run(argv, check=True, env=pip_env(), timeout=1800)


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    head = text.split("\n\n", 1)[0]
    return [line.split(":", 1)[1].strip() for line in head.splitlines() if line.startswith("Requires-Dist:")]


def closure(package: str, wheels: Mapping[str, Path], python: str, machine: str) -> set[str]:
    """Projects `package` needs on that Python and machine; pip download evaluates markers for its own Python."""
    from pip._vendor.packaging.requirements import Requirement  # pip makes the lock

    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "os_name": "posix",
        "platform_system": "Linux",
        "platform_machine": machine,
    }
    needed: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [(normalise(package), frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in wheels:
            raise RuntimeError(f"{name} is needed on Python {python} ({machine}) but pip did not download it")
        needed.add(name)
        for line in requires(wheels[name]):
            req = Requirement(line)
            applies = req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))
            if applies:
                todo.append((normalise(req.name), frozenset(req.extras)))
    return needed


def published_sha256(name: str, filename: str, index_url: str = INDEX_URL) -> str:
    """The sha256 the index publishes for a file (PEP 691)."""
    req = urllib.request.Request(
        f"{index_url.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        files = json.loads(resp.read())["files"]
    return str(next(f["hashes"]["sha256"] for f in files if f["filename"] == filename))


def lock_one(package: str, version: str, python: str, machine: str, index_url: str = INDEX_URL) -> list[dict[str, str]]:
    with tempfile.TemporaryDirectory(prefix=f"{package}-lock-") as tmp:
        dest = Path(tmp)
        download(package, version, python, machine, dest, index_url)
        files = {normalise(p.name.split("-")[0]): p for p in dest.iterdir() if p.name.endswith(".whl")}
        entries = []
        for name in sorted(closure(package, files, python, machine)):
            wheel = files[name]
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            if published_sha256(name, wheel.name, index_url) != digest:
                raise RuntimeError(f"{wheel.name}: the bytes pip fetched are not the ones the index publishes")
            entries.append(
                {"name": name, "version": wheel.name.split("-")[1], "filename": wheel.name, "sha256": digest}
            )
        return entries


def generate(
    of: LockFile, versions: Iterable[str], pythons: Iterable[str], machines: Iterable[str], index_url: str = INDEX_URL
) -> dict[str, Any]:
    jobs = [(v, p, m) for v in versions for p in pythons for m in machines]
    with ThreadPoolExecutor(max_workers=6) as pool:
        done = [f.result() for f in [pool.submit(lock_one, of.package, v, p, m, index_url) for v, p, m in jobs]]
    lock: dict[str, Any] = {
        "about": f"Every wheel gpufleet installs for {of.package}, per {of.setting}, Python and machine: made by "
        f"`{of.regenerate}` from {index_url}; regenerate it, never edit it ({of.doc}).",
        "releases": {},
    }
    for (v, p, m), entries in zip(jobs, done, strict=True):
        lock["releases"].setdefault(v, {}).setdefault(p, {})[m] = entries
    return lock


def write(lock: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(lock, indent=1, sort_keys=True) + "\n")


def pip_install_argv(venv_dir: str, index_url: str, requirements: str) -> list[str]:
    """pip installing exactly a lock's wheels from index_url; their hashes vouch for a plain-HTTP mirror."""
    argv = [
        f"{venv_dir}/bin/pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--require-hashes",
        "--only-binary",
        ":all:",
        "--no-deps",
        "--index-url",
        index_url,
    ]
    url = urlsplit(index_url)
    if url.scheme == "http" and url.hostname:
        argv += ["--trusted-host", url.hostname]
    return [*argv, "-r", requirements]
