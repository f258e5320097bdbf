"""`gpufleet init DIR`: a starter inventory for the user's boxes that renders and lints clean (docs/cli.md)."""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from gpufleet.defaults import DEFAULTS
from gpufleet.vllm.lint import NVIDIA_CONTROL_NODES, SHUTDOWN_TIMEOUT_S
from gpufleet.vllm.profiles import PROFILES, Profile
from gpufleet.vllm.profiles._profile import JIT_REDIRECTS

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ADDRESS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_USER = re.compile(r"[a-z_][a-z0-9_.-]*")
# At most 3 pipeline stages: lint rule qwen35-pipeline-parallel-4-or-more.
_TENSOR_SIZES = (1, 2, 4, 8)
_MAX_PIPELINE = 3


class BadInput(click.ClickException):
    """An option gpufleet init cannot use, named with its fix: exit status 2."""

    exit_code = 2


@dataclass(frozen=True)
class Box:
    name: str
    address: str
    gpus: tuple[int, ...]


def parse_hosts(values: Sequence[str]) -> list[tuple[str, str]]:
    if not values:
        raise BadInput(
            "--host: no host given (fix: --host NAME=ADDRESS, once per box, e.g. --host gpu-box-1=192.168.1.50)"
        )
    hosts: list[tuple[str, str]] = []
    for value in values:
        name, _, address = value.partition("=")
        name, address = name.strip(), address.strip()
        if not _NAME.fullmatch(name):
            raise BadInput(
                f"--host {value}: {name!r} is not a host name (fix: --host NAME=ADDRESS with a name of "
                "letters, digits, '.', '-' and '_', e.g. --host gpu-box-1=192.168.1.50)"
            )
        if not address:
            raise BadInput(f"--host {value}: no address (fix: --host {name}=ADDRESS, e.g. --host {name}=192.168.1.50)")
        if not _ADDRESS.fullmatch(address):
            raise BadInput(
                f"--host {value}: {address!r} is not a host name or IP address "
                f"(fix: --host {name}=192.168.1.50 or --host {name}=box.example.lan)"
            )
        if name in (n for n, _ in hosts):
            raise BadInput(f"--host {value}: {name} is given twice (fix: one --host per box, each with its own name)")
        hosts.append((name, address))
    return hosts


def parse_gpu_list(option: str, text: str) -> tuple[int, ...]:
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise BadInput(
            f"--gpus {option}: {text!r} is not a list of GPU indexes (fix: e.g. --gpus 0,1,2, the "
            "indexes nvidia-smi shows)"
        )
    gpus = tuple(int(item) for item in items)
    if len(set(gpus)) != len(gpus):
        raise BadInput(f"--gpus {option}: a GPU is listed twice (fix: each index once, e.g. --gpus 0,1,2)")
    return gpus


def parse_gpus(values: Sequence[str], names: Sequence[str], profile: Profile) -> dict[str, tuple[int, ...]]:
    """{host: GPUs} from `--gpus 0,1,2` for every host and `--gpus NAME=0,1` for one; else the profile's."""
    default: tuple[int, ...] = profile.gpus
    per_host: dict[str, tuple[int, ...]] = {}
    defaults_given = 0
    for value in values:
        if "=" in value:
            name, _, text = value.partition("=")
            if name not in names:
                raise BadInput(
                    f"--gpus {value}: no host {name!r} (fix: name one of the --host boxes: {', '.join(names)})"
                )
            per_host[name] = parse_gpu_list(value, text)
        else:
            defaults_given += 1
            if defaults_given > 1:
                raise BadInput(
                    f"--gpus {value}: a second list for every host (fix: one --gpus LIST for all hosts, "
                    "--gpus NAME=LIST for each host that differs)"
                )
            default = parse_gpu_list(value, value)
    return {name: per_host.get(name, default) for name in names}


def parallel_sizes(gpus: int) -> tuple[int, int] | None:
    """(tensor, pipeline) sizes: the most pipeline stages up to 3 with a power-of-two tensor size; None if none fits."""
    for pipeline in range(_MAX_PIPELINE, 0, -1):
        if gpus % pipeline == 0 and gpus // pipeline in _TENSOR_SIZES:
            return gpus // pipeline, pipeline
    return None


def _int_arg(profile: Profile, name: str, default: int) -> int:
    value = profile.vllm_args.get(name)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def fleet_args(profile: Profile) -> dict[str, Any]:
    """The fixes `gpufleet lint` asks of the profile's invocation for every box."""
    args: dict[str, Any] = {}
    if "shutdown-timeout" not in profile.vllm_args:
        args["shutdown-timeout"] = SHUTDOWN_TIMEOUT_S
    if "mamba-block-size" in profile.vllm_args and profile.vllm_args.get("mamba-cache-mode") == "align":
        args["mamba-block-size"] = None
    if profile.vllm_args.get("trust-remote-code") is True and profile.native:
        args["trust-remote-code"] = None
    return args


def fleet_env(profile: Profile) -> dict[str, Any]:
    env: dict[str, Any] = {}
    if "VLLM_USE_FLASHINFER_MOE_FP16" in profile.env:
        env["VLLM_USE_FLASHINFER_MOE_FP16"] = None
    if "PYTORCH_ALLOC_CONF" in profile.env and "PYTORCH_CUDA_ALLOC_CONF" not in profile.env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = profile.env["PYTORCH_ALLOC_CONF"]
    env |= {name: path for name, path in JIT_REDIRECTS.items() if name not in profile.env}
    return env


def box_args(profile: Profile, box: Box) -> dict[str, Any]:
    """The box's own flags: its parallel sizes, and enough sequences to keep each stage busy."""
    sizes = parallel_sizes(len(box.gpus))
    if sizes is None:
        fits = ", ".join(str(n) for n in range(1, 25) if parallel_sizes(n))
        raise BadInput(
            f"--gpus: {box.name} has {len(box.gpus)} GPUs, which no tensor x pipeline split known to "
            f"work uses (fix: list {fits} GPUs for it with --gpus {box.name}=LIST)"
        )
    tensor, pipeline = sizes
    args: dict[str, Any] = {}
    if tensor != _int_arg(profile, "tensor-parallel-size", 1):
        args["tensor-parallel-size"] = tensor
    if pipeline != _int_arg(profile, "pipeline-parallel-size", 1):
        args["pipeline-parallel-size"] = pipeline
    if _int_arg(profile, "max-num-seqs", 1024) < pipeline:
        args["max-num-seqs"] = pipeline
    return args


def _lit(value: Any) -> str:
    """A Python literal with double-quoted strings."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_lit(v) for v in value) + "]"
    return repr(value)


def _comment(text: str, indent: str = "") -> str:
    return (
        "\n".join(textwrap.wrap(text, 116 - len(indent), initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "))
        + "\n"
    )


def _dict(value: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{_lit(k)}: {_lit(v)}" for k, v in value.items()) + "}"


def _arg_comment(name: str) -> str:
    return {
        "shutdown-timeout": "On a restart (each deploy that changes the unit, each rollout) finish the answers being "
        "streamed for up to 60 s instead of cutting them off (docs/vllm-traps.md).",
        "mamba-block-size": "Ignored in align mode (vLLM uses the attention block size); explicit sizes have "
        "crashed hybrids (docs/vllm-traps.md).",
        "trust-remote-code": "The model's architecture is vLLM's own: no need to run the model repo's Python code.",
    }[name]


def _env_comment(name: str) -> str:
    return {
        "VLLM_USE_FLASHINFER_MOE_FP16": "Deprecated; newer vLLM logs it as unknown (docs/vllm-traps.md).",
        "PYTORCH_CUDA_ALLOC_CONF": "The profile's allocator settings under the name vLLM's torch reads "
        "(PYTORCH_ALLOC_CONF alone is ignored by some torch versions).",
        "TRITON_CACHE_DIR": "Triton's JIT cache in the vLLM cache mount: kept across restarts, carried by a rollout.",
        "FLASHINFER_WORKSPACE_BASE": "FlashInfer's JIT cache in the vLLM cache mount (docs/profiles.md).",
    }[name]


def _commented(value: dict[str, Any], comment: Any) -> str:
    if not value:
        return "{}"
    lines = "".join(f"{_comment(comment(k), '    ')}    {_lit(k)}: {_lit(v)},\n" for k, v in value.items())
    return "{\n" + lines + "}"


def inventory_text(directory: str, profile: Profile, boxes: Sequence[Box], routers: Sequence[str]) -> str:
    inventory = f"{directory.rstrip('/')}/inventory.py"
    host_lines = []
    for box in boxes:
        own = box_args(profile, box)
        tensor, pipeline = parallel_sizes(len(box.gpus)) or (1, 1)
        why = f"{len(box.gpus)} GPU(s): tensor parallel {tensor} x pipeline parallel {pipeline}"
        if "max-num-seqs" in own:
            why += "; max-num-seqs one sequence per pipeline stage, so no stage sits idle"
        host_lines.append(
            _comment(f"{why} (docs/profiles.md).", "    ")
            + f"    ({_lit(box.name)}, _box({_lit(box.address)}, {_lit(list(box.gpus))}"
            + (f", {_dict(own)}" if own else "")
            + ")),\n"
        )
    router_block = ""
    if routers:
        rows = "".join(
            f"    ({_lit(f'router-{i}')}, {_dict({'ssh_hostname': address, 'router_policy': 'cache_aware'})}),\n"
            for i, address in enumerate(routers, 1)
        )
        router_block = (
            "\n"
            + _comment(
                "One endpoint for every agent: vllm-router on a small CPU box in front of the boxes above (docs/router.md). "
                f"Clients then talk to http://{routers[0]}:8000/v1 with the API key of group_data/all.py. router_policy "
                "cache_aware sends a conversation's turns to the replica holding its prefix cache (README.md, \"Fleets with "
                'one endpoint for all agents"). `gpufleet deploy` deploys the routers after the boxes.'
            )
            + f"routers = [\n{rows}]\n"
        )
    accept_why = (
        "The prefix-match unit must divide the block size each server resolves at start-up, which only a "
        f"running server knows: after the first deploy `gpufleet verify {inventory} --probe` prints the unit "
        "for each box; set vllm_args prefix-match-unit to it (in gpu_boxes below) and drop this line."
    )
    return f'''"""Starter fleet written by `gpufleet init` (profile {profile.name}): edit it freely.

Check it:           gpufleet lint {inventory} --strict
See what it runs:   gpufleet render {inventory} --host {boxes[0].name}
Converge it:        gpufleet deploy {inventory}        (--dry: show the changes and stop)
Is it serving:      gpufleet verify {inventory}

Fleet-wide settings live in group_data/all.py; per-host settings below win over them. Every setting, its default
and its meaning: README.md ("Settings") and gpufleet/defaults.py; the profiles: docs/profiles.md.
"""

# Names starting with "_" are no host groups: pyinfra skips them. A host's setting replaces the group's value as a
# whole (a host's vllm_args is not merged into the group's vllm_args), so every box below starts from these.

# The fixes `gpufleet lint` asks of the profile's invocation (docs/lint.md, docs/vllm-traps.md).
_VLLM_ARGS = {_commented(fleet_args(profile), _arg_comment)}
# Likewise for the container's environment (vllm_env; README.md "Settings").
_VLLM_ENV = {_commented(fleet_env(profile), _env_comment)}
# Findings accepted on purpose: `gpufleet lint` lists them as accepted and does not count them (docs/lint.md).
_ACCEPTED = [
{_comment(accept_why, "    ")}    "hybrid-align-chunk-alignment",
]


def _gpu_access(gpus: list[int]) -> dict:
    """Only these GPUs in the container, kept across a `systemctl daemon-reload`: no --privileged, the GPUs' device
    nodes listed (docs/vllm-traps.md). /dev/nvidia<N> is the GPU's minor number, its index on most hosts: check
    `nvidia-smi -q | grep Minor` on a new box."""
    nodes = [{", ".join(_lit(n) for n in NVIDIA_CONTROL_NODES)}, *(f"/dev/nvidia{{g}}" for g in gpus)]
    return {{"vllm_gpus": gpus, "vllm_docker_options": {{"privileged": None, "device": nodes}}}}


def _box(address: str, gpus: list[int], vllm_args: dict | None = None) -> dict:
    """A box's host data: its address (pyinfra's ssh_hostname), its GPUs (vllm_gpus), and the fleet's flags with
    its own over them (vllm_args, vllm_env: README.md "Settings")."""
    return {{"ssh_hostname": address, **_gpu_access(gpus), "vllm_args": {{**_VLLM_ARGS, **(vllm_args or {{}})}},
            "vllm_env": _VLLM_ENV, "gpufleet_accept": _ACCEPTED}}


# The vLLM hosts (group gpu_boxes): name, SSH address, GPU indexes, own flags (README.md "Settings").
gpu_boxes = [
{"".join(host_lines)}]
{router_block}'''


def group_data_text(profile: Profile, ssh_user: str, api_key: str) -> str:
    return f'''"""Fleet-wide settings for every host of inventory.py (host data there overrides these; README.md "Settings")."""

# How pyinfra logs in: a user with passwordless sudo on every box (docs/deploy.md).
ssh_user = {_lit(ssh_user)}
_sudo = True  # pyinfra global argument: every operation runs with sudo

# The known-good service definition each box starts from: {", ".join(PROFILES)} (docs/profiles.md).
vllm_profile = {_lit(profile.name)}
# The vLLM image: each deploy pins the tag's digest; `gpufleet rollout` moves the fleet to a newer one
# (docs/rollout.md).
vllm_image = {_lit(DEFAULTS["vllm_image"])}
# Agents send it as `Authorization: Bearer <key>`; it is kept in a root-only file on each host (docs/hardening.md).
# Generated by `gpufleet init`: keep this file private, or read the key from elsewhere, e.g. os.environ[...].
vllm_api_key = {_lit(api_key)}
'''


@click.command()
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option(
    "--host",
    "hosts",
    multiple=True,
    metavar="NAME=ADDRESS",
    help="A box: its inventory name and the address pyinfra reaches it at over SSH. Repeat per box.",
)
@click.option(
    "--gpus",
    "gpus",
    multiple=True,
    metavar="LIST|NAME=LIST",
    help="GPU indexes to serve on, e.g. 0,1,2: for every box, or NAME=0,1 for one (default: the "
    "profile's). The parallel sizes follow the count.",
)
@click.option(
    "--profile",
    "profile_name",
    default="qwen35",
    show_default=True,
    metavar="NAME",
    help=f"The service definition: {', '.join(PROFILES)} (docs/profiles.md).",
)
@click.option(
    "--router",
    "routers",
    multiple=True,
    metavar="ADDRESS",
    help="A small CPU box to run vllm-router in front of the boxes (the `routers` inventory group). Repeatable.",
)
@click.option("--ssh-user", default="deploy", show_default=True, help="The SSH user, with passwordless sudo.")
@click.option("--force", is_flag=True, help="Overwrite DIR/inventory.py and DIR/group_data/all.py if they exist.")
def init(
    directory: str,
    hosts: tuple[str, ...],
    gpus: tuple[str, ...],
    profile_name: str,
    routers: tuple[str, ...],
    ssh_user: str,
    force: bool,
) -> None:
    """Write a starter inventory for your boxes: DIR/inventory.py and DIR/group_data/all.py.

    It renders and lints clean; every setting carries a comment pointing to the docs. A random API key is
    generated into group_data/all.py. Existing files are left alone unless --force.

    \b
    Example:
        gpufleet init fleet --host gpu-box-1=192.168.1.50 --host gpu-box-2=192.168.1.51 --gpus gpu-box-2=0,1
        gpufleet lint fleet/inventory.py --strict && gpufleet deploy fleet/inventory.py
    """
    if profile_name not in PROFILES:
        raise BadInput(f"--profile {profile_name}: no such profile (fix: one of {', '.join(PROFILES)})")
    profile = PROFILES[profile_name]
    parsed = parse_hosts(hosts)
    names = [name for name, _ in parsed]
    per_host = parse_gpus(gpus, names, profile)
    for address in routers:
        if not _ADDRESS.fullmatch(address):
            raise BadInput(f"--router {address}: not a host name or IP address (fix: e.g. --router 192.168.1.40)")
    if not _USER.fullmatch(ssh_user):
        raise BadInput(f"--ssh-user {ssh_user}: not a user name (fix: e.g. --ssh-user deploy)")
    boxes = [Box(name, address, per_host[name]) for name, address in parsed]
    for box in boxes:
        box_args(profile, box)  # refuses before anything is written

    root = Path(directory)
    files = {
        root / "inventory.py": inventory_text(directory, profile, boxes, routers),
        root / "group_data" / "all.py": group_data_text(profile, ssh_user, "sk-" + secrets.token_hex(24)),
    }
    existing = [str(path) for path in files if path.exists()]
    if existing and not force:
        raise BadInput(
            f"{', '.join(existing)}: already exists, left as it is (fix: another DIR, or --force to overwrite)"
        )
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        # It holds the API key: owner only.
        _replace(path, text, 0o600 if path.name == "all.py" else 0o644)
        click.echo(f"wrote {path}")
    click.echo(f"next: gpufleet lint {root / 'inventory.py'} --strict && gpufleet deploy {root / 'inventory.py'}")


def _replace(path: Path, text: str, mode: int) -> None:
    """Write `path` with `mode` from its first byte, by a rename that replaces a link instead of following it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
