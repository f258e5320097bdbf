"""Each operation on its own: its inputs as arguments, a snapshot set for the host, its commands read back."""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.context import ctx_host, ctx_state

from gpufleet.facts.nvidia import NvidiaVersion
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.hoststate.ledger import Committed, Ledger, Version
from gpufleet.hoststate.paths import ledger_path
from gpufleet.operations.run import remember
from gpufleet.operations.secret import Hidden
from gpufleet.units import unit_path
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations import docker, image, nvidia, repo_keys, service
from gpufleet.vllm.operations.service import env_content
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit

TAG = "reg:5000/vllm/vllm-openai:nightly"
PINNED = "reg:5000/vllm/vllm-openai@sha256:" + "1" * 64
RESOLVED = "reg:5000/vllm/vllm-openai@sha256:" + "2" * 64


def run_alone(
    operation: Any,
    snap: HostSnapshot,
    resolved: str | None = None,
    ledger: Ledger | None = None,
    executing: bool = False,
    **arguments: Any,
) -> list[Any]:
    inventory = Inventory(([("gpu1", {})], {}))
    target = inventory.get_host("gpu1")
    state = State(inventory, Config())
    state.is_executing = executing
    held = remember(target, snap)
    held.resolved_ref, held.ledger = resolved, ledger or Ledger()
    with ctx_state.use(state), ctx_host.use(target):
        return list(operation._inner(**arguments))


def test_env_file_takes_hidden_secrets_and_never_shows_them():
    secrets = {"VLLM_API_KEY": Hidden("sk-s3cret"), "HF_TOKEN": None}
    locked, command = run_alone(service.env_file, HostSnapshot(), path="/etc/gpufleet/v.env", secrets=secrets)
    assert locked.function.__name__ == "still_locked"  # checked at execution time, before the secret is written
    assert isinstance(command, FunctionCommand) and "s3cret" not in repr(command)
    written = hashlib.sha256(env_content({"VLLM_API_KEY": "sk-s3cret"}).encode()).hexdigest()
    assert (
        run_alone(
            service.env_file,
            HostSnapshot(file_sha256={"/etc/gpufleet/v.env": written}),
            path="/etc/gpufleet/v.env",
            secrets=secrets,
        )
        == []
    )


def recorded(ref: str = PINNED) -> Ledger:
    return Ledger(committed=Committed(Version(TAG, ref, None, None, "v", 5000), "t0"))


def test_pinned_reuses_the_recorded_digest_and_pulls_a_missing_one_by_digest():
    present = HostSnapshot(images=[("reg:5000/vllm/vllm-openai", "<none>", "sha256:" + "1" * 64)])
    assert run_alone(image.pinned, present, image=TAG, ref=PINNED) == []
    (pull,) = run_alone(image.pinned, HostSnapshot(), image=TAG, ref=PINNED)
    assert pull.args == (TAG, PINNED)
    (pull,) = run_alone(image.pinned, HostSnapshot(), image=TAG, ref=None)  # a tag never resolved on the host
    assert pull.args == (TAG, TAG)


def test_unit_renders_the_digest_resolved_while_executing_over_the_recorded_one():
    spec = build_spec("gpu1", {"vllm_image": TAG})
    path = unit_path(spec.service)
    snap = HostSnapshot(file_sha256={path: hashlib.sha256(render_unit(spec, PINNED).encode()).hexdigest()})
    # the pin (the recorded digest) is what runs
    assert (
        run_alone(
            service.unit,
            snap,
            ledger=recorded(),
            spec=spec,
            path=path,
            ledger_path=ledger_path("v"),
            pin=PINNED,
            retry_failed=False,
        )
        == []
    )
    commands = run_alone(
        service.unit,
        snap,
        resolved=RESOLVED,
        ledger=recorded(),
        spec=spec,
        path=path,
        ledger_path=ledger_path("v"),
        pin=PINNED,
        retry_failed=False,
    )
    (upload,) = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert upload.src.getvalue().decode() == render_unit(spec, RESOLVED)


VERSION = "NVIDIA-SMI version  : 580.159.04\nDRIVER version      : 580.159.04\nCUDA Version        : 13.0\n"


def test_version_file_records_what_nvidia_smi_answered_live_when_the_file_differs():
    live = HostSnapshot(nvidia_smi=True, driver=NvidiaVersion("580.159.04", "13.0"), driver_output=VERSION)
    mkdir, upload = run_alone(nvidia.version_file, live)
    assert mkdir.get_raw_value() == "install -d -m 755 /var/lib/gpufleet"  # a host gpufleet never converged
    assert (
        isinstance(upload, FileUploadCommand)
        and upload.dest == nvidia.VERSION_FILE == "/var/lib/gpufleet/nvidia-version"
    )
    assert upload.src.getvalue() == VERSION.encode() and upload.mode == "644"
    live.file_sha256[nvidia.VERSION_FILE] = hashlib.sha256(b"DRIVER version : 535.104.05\n").hexdigest()
    assert len(run_alone(nvidia.version_file, live)) == 2  # another driver's answer is replaced
    live.file_sha256[nvidia.VERSION_FILE] = hashlib.sha256(VERSION.encode()).hexdigest()
    assert run_alone(nvidia.version_file, live) == []


def test_version_file_writes_nothing_when_read_from_it_or_without_a_usable_answer():
    from_file = HostSnapshot(nvidia_smi=True, driver=NvidiaVersion("580.159.04", "13.0"), driver_from_file=True)
    broken = HostSnapshot(nvidia_smi=True, nvidia_error="nvidia-smi failed: NVIDIA-SMI has failed")
    for snap in (from_file, broken, HostSnapshot()):  # HostSnapshot(): no nvidia-smi
        assert run_alone(nvidia.version_file, snap) == []


# --- repo keys: the installed keyring stands; fetched while executing only when apt reads the repo -------------------
ARMORED = (
    "-----BEGIN PGP PUBLIC KEY BLOCK-----\n\n"
    + base64.b64encode(b"key" * 40).decode()
    + "\n-----END PGP PUBLIC KEY BLOCK-----\n"
)
ROTATED = ARMORED.replace("a2V5", "S0VZ", 1)  # another key: "KEY" where the first "key" was
NVIDIA_URL = "http://repo.example/nvidia"
DOCKER_URL = "http://repo.example/docker/linux"
DEBIAN = {"ID": "debian", "VERSION_CODENAME": "bookworm"}


def converged_keys(**over: Any) -> HostSnapshot:
    """A converged host's snapshot as a no-op converge reads it: keyrings and lists installed, packages installed,
    no key fetched (the snapshot asks for none while the keyrings exist)."""
    files = {
        nvidia.KEYRING: repo_keys.dearmor(ARMORED),
        nvidia.LIST: nvidia.list_line(NVIDIA_URL).encode(),
        docker.DOCKER_KEY: ARMORED.encode(),
        docker.DOCKER_LIST: docker.repo_line(DOCKER_URL, "debian", "bookworm", "amd64").encode(),
    }
    return HostSnapshot(
        os=dict(DEBIAN),
        arch="amd64",
        packages=dict.fromkeys([nvidia.PACKAGE, *docker.CE_PACKAGES, "curl"], "1"),
        file_sha256={path: hashlib.sha256(content).hexdigest() for path, content in files.items()},
        **over,
    )


def fetches(commands: list[Any]) -> list[tuple[Any, ...]]:
    return [c.args for c in commands if isinstance(c, FunctionCommand) and c.function is repo_keys.install_fetched_key]


def test_a_converged_host_is_a_no_op_whatever_the_key_servers_do():
    # The bug this fixes: the snapshot fetched both keys on every converge, and a key server that did not answer
    # (an offline fleet) made every host fetch again while executing, report a change and fail.
    snap = converged_keys()
    assert run_alone(nvidia.toolkit_repo, snap, repo_url=NVIDIA_URL) == []
    assert run_alone(docker.engine, snap, repo_url=DOCKER_URL) == []


@pytest.fixture
def apt_installs(monkeypatch):
    """pyinfra's apt.packages reads its own facts over SSH: stood in for by one command naming the packages."""

    def packages(packages: list[str], **_: Any):
        yield StringCommand("apt-install", *packages)

    monkeypatch.setattr(docker.apt.packages, "_inner", packages)
    monkeypatch.setattr(nvidia.apt.packages, "_inner", packages)


def test_a_missing_keyring_is_fetched_while_executing_when_the_snapshot_got_none():
    # No curl when the snapshot ran (the deploy installs it first), or the key server did not answer then.
    snap = converged_keys()
    del snap.file_sha256[nvidia.KEYRING], snap.file_sha256[docker.DOCKER_KEY]
    (fetch,) = run_alone(nvidia.toolkit_repo, snap, repo_url=NVIDIA_URL)
    assert fetches([fetch]) == [(f"{NVIDIA_URL}/gpgkey", nvidia.KEYRING, repo_keys.dearmor, None, "nvidia_repo_url")]
    fetch, update = run_alone(docker.engine, snap, repo_url=DOCKER_URL)
    assert fetches([fetch]) == [
        (f"{DOCKER_URL}/debian/gpg", docker.DOCKER_KEY, docker.armored, None, "docker_repo_url")
    ]
    assert update.get_raw_value() == "apt-get update -q"  # the new key reaches apt's lists


def test_a_package_to_install_fetches_the_key_first_so_a_rotated_key_is_picked_up(apt_installs):
    snap = converged_keys()
    del snap.packages[nvidia.PACKAGE], snap.packages["containerd.io"]
    (fetch,) = run_alone(nvidia.toolkit_repo, snap, repo_url=NVIDIA_URL)
    assert fetches([fetch])[0][3] == snap.file_sha256[nvidia.KEYRING]  # rewritten only if the served one differs
    fetch, install = run_alone(docker.engine, snap, repo_url=DOCKER_URL)
    assert fetches([fetch])[0][:2] == (f"{DOCKER_URL}/debian/gpg", docker.DOCKER_KEY)
    assert install.get_raw_value() == "apt-install containerd.io"


def test_a_changed_repo_fetches_its_key_before_its_source_line():
    snap = converged_keys()
    commands = run_alone(nvidia.toolkit_repo, snap, repo_url="http://mirror.example/nvidia")
    assert fetches(commands)[0][0] == "http://mirror.example/nvidia/gpgkey"
    assert isinstance(commands[0], FunctionCommand) and commands[-1].dest == nvidia.LIST
    commands = run_alone(docker.engine, snap, repo_url="http://mirror.example/linux")
    assert fetches(commands)[0][0] == "http://mirror.example/linux/debian/gpg"
    assert [c.dest for c in commands if isinstance(c, FileUploadCommand)] == [docker.DOCKER_LIST]


def test_a_refresh_replaces_a_rotated_key_and_nothing_else():
    same = converged_keys(nvidia_key=ARMORED, docker_key=ARMORED)
    assert run_alone(nvidia.toolkit_repo, same, repo_url=NVIDIA_URL, refresh_keys=True) == []
    assert run_alone(docker.engine, same, repo_url=DOCKER_URL, refresh_keys=True) == []
    rotated = converged_keys(nvidia_key=ROTATED, docker_key=ROTATED)
    _mkdir, upload = run_alone(nvidia.toolkit_repo, rotated, repo_url=NVIDIA_URL, refresh_keys=True)
    assert upload.dest == nvidia.KEYRING and upload.src.getvalue() == repo_keys.dearmor(ROTATED)
    _mkdir, upload, update = run_alone(docker.engine, rotated, repo_url=DOCKER_URL, refresh_keys=True)
    assert upload.dest == docker.DOCKER_KEY and upload.src.getvalue() == ROTATED.encode()
    assert update.get_raw_value() == "apt-get update -q"


def test_a_refresh_whose_fetch_failed_keeps_the_installed_key_and_says_so(caplog):
    snap = converged_keys()  # refresh asked, the key server did not answer: no key in the snapshot
    with caplog.at_level(logging.WARNING):
        assert run_alone(nvidia.toolkit_repo, snap, repo_url=NVIDIA_URL, refresh_keys=True) == []  # the plan: silent
        assert run_alone(nvidia.toolkit_repo, snap, executing=True, repo_url=NVIDIA_URL, refresh_keys=True) == []
        assert run_alone(docker.engine, snap, executing=True, repo_url=DOCKER_URL, refresh_keys=True) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [re.sub(r"\x1b\[[0-9;]*m", "", w).split("] ", 1)[-1] for w in warnings] == [
        f"gpu1: could not fetch {NVIDIA_URL}/gpgkey to check for a rotated key; kept the installed {nvidia.KEYRING}",
        f"gpu1: could not fetch {DOCKER_URL}/debian/gpg to check for a rotated key; kept the installed "
        f"{docker.DOCKER_KEY}",
    ]


class KeyHost:
    """What install_fetched_key uses of a pyinfra Host: commands answered from `answers`, uploads and logs kept."""

    name, data, connector = "gpu1", {"ssh_user": "root"}, None

    def __init__(self, fetched: tuple[bool, str, str]):
        self.fetched, self.commands, self.uploads, self.logged = fetched, [], [], []

    def run_shell_command(self, command: str, **_: Any):
        self.commands.append(str(command))
        ok, out, err = self.fetched if str(command).startswith("curl ") else (True, "", "")
        if str(command).endswith("mktemp -d"):
            out = "/tmp/tmp.key"
        return ok, SimpleNamespace(stdout_lines=out.splitlines(), stderr_lines=err.splitlines())

    def put_file(self, src: Any, dest: str, **_: Any) -> bool:
        self.uploads.append((dest, src.getvalue()))
        return True

    def log_styled(self, message: str, **_: Any) -> None:
        self.logged.append(message)


def test_the_execute_time_fetch_writes_a_different_key_and_skips_the_same():
    target = KeyHost((True, ROTATED, ""))
    assert repo_keys.install_fetched_key(
        None,
        target,
        "http://r/gpgkey",
        nvidia.KEYRING,
        repo_keys.dearmor,
        hashlib.sha256(repo_keys.dearmor(ARMORED)).hexdigest(),
        "nvidia_repo_url",
    )
    # Uploaded into a private temp dir, then copied by root beside the keyring, checked and renamed over it.
    key = repo_keys.dearmor(ROTATED)
    assert target.uploads == [("/tmp/tmp.key/upload", key)]
    assert target.commands[-2:] == [
        atomic_write_command(nvidia.KEYRING, source="/tmp/tmp.key/upload", sha256=hashlib.sha256(key).hexdigest()),
        "rm -rf /tmp/tmp.key",
    ]
    same = KeyHost((True, ARMORED, ""))
    assert repo_keys.install_fetched_key(
        None,
        same,
        "http://r/gpgkey",
        nvidia.KEYRING,
        repo_keys.dearmor,
        hashlib.sha256(repo_keys.dearmor(ARMORED)).hexdigest(),
        "nvidia_repo_url",
    )
    assert same.uploads == [] and len(same.commands) == 1


@pytest.mark.parametrize(
    ("fetched", "reason"),
    [
        (
            (False, "", "curl: (7) Failed to connect to r port 80: Connection refused"),
            "curl: (7) Failed to connect to r port 80: Connection refused",
        ),
        ((True, "<html>not found</html>", ""), "not an ASCII-armored PGP public key block"),
    ],
    ids=["unreachable", "not-a-key"],
)
def test_a_failed_execute_time_fetch_fails_the_host_on_one_line(fetched, reason):
    target = KeyHost(fetched)
    assert not repo_keys.install_fetched_key(
        None, target, "http://r/linux/debian/gpg", docker.DOCKER_KEY, docker.armored, None, "docker_repo_url"
    )
    assert target.logged == [
        f"gpu1: could not fetch the repo key http://r/linux/debian/gpg: {reason} (fix: make "
        "http://r/linux/debian/gpg reachable from gpu1, or set docker_repo_url to a mirror that "
        "serves it)"
    ]
    assert target.uploads == []
