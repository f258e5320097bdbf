"""The settings of one value each, checked alone. Each check records its problems through `fail`, one line each, and
returns the value the spec is built with.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from gpufleet.defaults import (
    DEFAULTS,
    EXPECT_COMMITTED_SETTING,
    IMAGE_REF_SETTING,
    LEASE_SETTING,
    MODEL_SHA_SETTING,
    WAIT_SETTING,
)
from gpufleet.errors import shown
from gpufleet.image_names import parse as parse_image
from gpufleet.names import SERVICE_NAME
from gpufleet.vllm.value_rules import Fail, check_secret_value, not_finite

_HF_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_HF_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_URL = re.compile(
    r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
    r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?(?:/[A-Za-z0-9._~+-]*)*"
)
# Heartbeats come every quarter of the lease: shorter, a busy controller would lose its own lock.
MIN_LOCK_LEASE_S = 2
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# Units a host needs to be reached and run containers: the deploy would replace and restart them.
_SYSTEM_UNITS = frozenset(
    {
        "ssh",
        "sshd",
        "docker",
        "containerd",
        "dbus",
        "dbus-broker",
        "cron",
        "crond",
        "anacron",
        "atd",
        "networking",
        "network",
        "networkmanager",
        "network-online",
        "wpa_supplicant",
        "getty",
        "serial-getty",
        "console-getty",
        "rsyslog",
        "syslog",
        "auditd",
        "polkit",
        "udev",
        "chrony",
        "chronyd",
        "ntp",
        "ntpd",
        "ntpsec",
        "apparmor",
        "ufw",
        "firewalld",
        "nftables",
        "iptables",
        "netfilter-persistent",
        "unattended-upgrades",
        "apt-daily",
        "apt-daily-upgrade",
        "snapd",
        "multipathd",
        "lvm2-monitor",
        "kubelet",
        "nvidia-persistenced",
        "nvidia-fabricmanager",
        "nvidia-dcgm",
        "dcgm",
        "emergency",
        "rescue",
        "default",
        "multi-user",
        "graphical",
        "basic",
        "sysinit",
        "shutdown",
        "reboot",
        "poweroff",
        "halt",
        "user",
        "init",
        "sockets",
        "timers",
        "paths",
        "local-fs",
        "remote-fs",
        "swap",
        "cloud-init",
        "cloud-config",
        "cloud-final",
        "cloud-init-local",
    }
)
_SYSTEM_UNIT_PREFIXES = ("systemd-", "getty", "serial-getty", "lvm2-", "cloud-init")
_UNIT_SUFFIXES = (
    ".service",
    ".socket",
    ".target",
    ".timer",
    ".path",
    ".mount",
    ".automount",
    ".swap",
    ".slice",
    ".scope",
    ".device",
)
# Directories the deploy must never take over: it creates the models and cache dirs root-owned with mode 755
# (so /tmp would lose its sticky, world-writable 1777).
SYSTEM_DIRS = frozenset(
    {
        "/",
        "/tmp",
        "/var/tmp",
        "/etc",
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/boot",
        "/dev",
        "/proc",
        "/sys",
        "/run",
        "/var",
        "/var/lib",
        "/var/cache",
        "/var/log",
        "/var/run",
        "/var/spool",
        "/var/mail",
        "/var/lib/docker",
        "/var/lib/containerd",
        "/home",
        "/root",
        "/opt",
        "/srv",
        "/mnt",
        "/media",
        "/snap",
        "/lost+found",
    }
)
# ... nor anything inside these (kernel file systems, the OS, Docker's own data).
SYSTEM_TREES = (
    "/proc",
    "/sys",
    "/dev",
    "/run",
    "/boot",
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/var/lib/docker",
    "/var/lib/containerd",
)


def check_image_ref(value: Any, image: str, fail: Fail) -> str | None:
    """gpufleet_image_ref: None, or a digest of vllm_image's repository (what a rollout installs)."""
    if value is None:
        return None
    ref = parse_image(value) if isinstance(value, str) else None
    if ref is None or ref.digest is None or not _DIGEST.fullmatch(ref.digest):
        fail(
            IMAGE_REF_SETTING,
            f"{shown(value)} is not a digest reference",
            'use "repo@sha256:<64 hex digits>", or None to install vllm_image',
        )
        return None
    wanted = parse_image(image)
    if wanted is not None and ref.repository != wanted.repository:
        fail(
            IMAGE_REF_SETTING,
            f"{shown(value)} is not of vllm_image's repository {wanted.repository}",
            f"use {wanted.repository}@sha256:<digest>, or change vllm_image to that repository",
        )
        return None
    return ref.pinned


def check_expect_committed(value: Any, fail: Fail) -> None:
    """gpufleet_expect_committed: None, or {host name: committed digest or None}."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in value.items()
    ):
        fail(
            EXPECT_COMMITTED_SETTING,
            f"{shown(value)} is not a map of host name to digest",
            'pass --data \'gpufleet_expect_committed={"gpu1": "repo@sha256:...", "gpu2": null}\', or leave it unset',
        )


def check_image(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or parse_image(value) is None:
        fail("vllm_image", f"{shown(value)} is not an image reference", 'use "repo:tag" or "repo@sha256:<digest>"')
        return ""
    return value


def check_gpus(value: Any, fail: Fail) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        fail("vllm_gpus", f"{shown(value)} is not a non-empty list of GPU indexes", "set e.g. [0, 1, 2]")
        return ()
    if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024 for g in value):
        fail("vllm_gpus", f"{shown(list(value))} must hold non-negative integers", "set e.g. [0, 1, 2]")
        return ()
    if len(set(value)) != len(value):
        fail("vllm_gpus", f"{shown(list(value))} lists a GPU twice", f"list each GPU once: {sorted(set(value))}")
    return tuple(value)


def check_port(value: Any, fail: Fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        fail("vllm_port", f"{shown(value)} is not a port number", "use an integer from 1 to 65535, e.g. 5000")
        return 0
    return value


def check_publish_address(value: Any, fail: Fail) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            # docker takes exactly an IP here, v4 or v6.
            return str(ipaddress.ip_address(value))
        except ValueError:
            pass
    fail(
        "vllm_publish_address",
        f"{shown(value)} is not an IP address of the host",
        'use None (every interface) or an address such as "127.0.0.1"',
    )
    return None


def check_service(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or not SERVICE_NAME.fullmatch(value):
        fail("vllm_service", f"{shown(value)} is not a valid unit/label name", "use letters, digits, '-', '_' and '.'")
    elif value.endswith(_UNIT_SUFFIXES):
        bare = value.rsplit(".", 1)[0]
        fail(
            "vllm_service",
            f"{shown(value)} carries a unit suffix; gpufleet adds .service itself",
            f'set "{bare}"' if not _system_unit(bare) else 'use a name of its own, e.g. "vllm-qwen35"',
        )
    elif _system_unit(value):
        fail(
            "vllm_service",
            f"{shown(value)} names a system unit, which the deploy would replace and restart",
            'use a name of its own, e.g. "vllm-qwen35"',
        )
    return value if isinstance(value, str) else ""


def _system_unit(name: str) -> bool:
    lowered = name.lower()
    return lowered in _SYSTEM_UNITS or lowered.startswith(_SYSTEM_UNIT_PREFIXES)


def check_abs_dir(setting: str, value: Any, example: str, fail: Fail) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        fail(setting, f"{shown(value)} is not an absolute path", "use an absolute path (systemd does not expand ~)")
        return "/"
    if ":" in value or "," in value:
        fail(
            setting,
            f"{shown(value)} holds ':' or ',', which docker's -v and --mount split on",
            "use a path without ':' or ','",
        )
        return "/"
    path = posixpath.normpath(value)
    path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
    if path in SYSTEM_DIRS or any(path.startswith(tree + "/") for tree in SYSTEM_TREES):
        fail(
            setting,
            f"{shown(value)} is a system directory, which the deploy would chown to root and chmod 755",
            f"use a directory of its own, e.g. {example}",
        )
    return path


def check_plain_settings(s: Mapping[str, Any], fail: Fail) -> None:
    for secret in ("vllm_hf_token", "vllm_api_key"):
        check_secret_value(secret, s[secret], fail, optional=True)
    if s["vllm_model_repo"] is not None and (
        not isinstance(s["vllm_model_repo"], str) or not _HF_REPO.fullmatch(s["vllm_model_repo"])
    ):
        fail(
            "vllm_model_repo",
            f"{shown(s['vllm_model_repo'])} is not a Hugging Face repo id",
            'use "namespace/name", e.g. "Qwen/Qwen3.5-27B-FP8", or None',
        )
    if s["vllm_model_revision"] is not None and (
        not isinstance(s["vllm_model_revision"], str) or not _HF_REVISION.fullmatch(s["vllm_model_revision"])
    ):
        fail(
            "vllm_model_revision",
            f"{shown(s['vllm_model_revision'])} is not a branch, tag or commit",
            'e.g. "main" or a commit hash, or None',
        )
    sha = s[MODEL_SHA_SETTING]
    if sha is not None and (not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{40}", sha)):
        fail(MODEL_SHA_SETTING, f"{shown(sha)} is not a commit of vllm_model_repo", "a 40-hex commit id, or None")
    elif sha is not None and s["vllm_model_repo"] is None:
        fail(MODEL_SHA_SETTING, "is set but vllm_model_repo is None", "set vllm_model_repo, or drop it")
    hub = urlsplit(s["vllm_hf_endpoint"]) if isinstance(s["vllm_hf_endpoint"], str) else None
    if hub is None or hub.scheme not in ("http", "https") or not hub.hostname or hub.query or " " in hub.geturl():
        fail(
            "vllm_hf_endpoint",
            f"{shown(s['vllm_hf_endpoint'])} is not an http(s) URL",
            f'e.g. "{DEFAULTS["vllm_hf_endpoint"]}"',
        )
    for key in (
        "vllm_ready_timeout",
        "vllm_ready_soak_s",
        "gpufleet_min_free_gb_docker",
        "gpufleet_min_free_gb_models",
        WAIT_SETTING,
        LEASE_SETTING,
    ):
        value = s[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not_finite(value) or value < 0:
            fail(key, f"{shown(value)} is not a finite non-negative number", f"e.g. {DEFAULTS[key]}")
        elif key == LEASE_SETTING and value < MIN_LOCK_LEASE_S:
            fail(key, f"{shown(value)} is below {MIN_LOCK_LEASE_S} s", f"e.g. {DEFAULTS[key]}")
    if not isinstance(s["gpufleet_min_cuda"], str) or not re.fullmatch(r"[0-9]+\.[0-9]+", s["gpufleet_min_cuda"]):
        fail(
            "gpufleet_min_cuda",
            f"{shown(s['gpufleet_min_cuda'])} is not a CUDA version",
            'use "MAJOR.MINOR", e.g. "13.0"',
        )
    if not isinstance(s["gpufleet_allow_no_gpu"], bool):
        fail("gpufleet_allow_no_gpu", f"{shown(s['gpufleet_allow_no_gpu'])} is not True/False", "set True or False")


def check_install_settings(s: Mapping[str, Any], fail: Fail) -> None:
    if s["docker_install"] not in ("docker-ce", "distro"):
        fail("docker_install", f"{shown(s['docker_install'])} is not an install method", 'use "docker-ce" or "distro"')
    for key in ("docker_repo_url", "nvidia_repo_url"):
        # The URL reaches a root shell and an apt sources line: only plain http(s)://host[:port]/path.
        if not isinstance(s[key], str) or not _URL.fullmatch(s[key]):
            fail(
                key,
                f"{shown(s[key])} is not a plain http(s) URL",
                f"use http(s)://host[:port]/path of letters, digits and ._~+-, e.g. {DEFAULTS[key]}",
            )


def _network(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


# A DNS name or IPv4 address and a port: docker's insecure-registries entry and a pull reference.
_CACHE_ADDRESS = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?:[0-9]{1,5}")


def check_site_cache(s: Mapping[str, Any], fail: Fail) -> None:
    for key in ("site_cache_port", "site_cache_internal_port", "site_cache_mirror_port"):
        port = s[key]
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            fail(key, f"{shown(port)} is not a TCP port", f"e.g. {DEFAULTS[key]}")
    if s["site_cache_internal_port"] == s["site_cache_port"]:
        fail(
            "site_cache_internal_port",
            "is site_cache_port too",
            f"use another port, e.g. {DEFAULTS['site_cache_internal_port']}",
        )
    clients = s["site_cache_clients"]
    if not isinstance(clients, (list, tuple)) or not all(isinstance(c, str) and _network(c) for c in clients):
        fail(
            "site_cache_clients",
            f"{shown(clients)} is not a list of addresses or networks",
            'e.g. ["10.0.1.0/24", "10.0.2.7"]',
        )
    for key in ("site_cache_max_gb", "site_cache_model_max_gb"):
        size = s[key]
        if not isinstance(size, (int, float)) or isinstance(size, bool) or not_finite(size) or size <= 0:
            fail(key, f"{shown(size)} is not a positive number of GB", f"e.g. {DEFAULTS[key]}")
    index = s["site_cache_mirror_index_url"]
    if not isinstance(index, str) or not _URL.fullmatch(index):
        fail(
            "site_cache_mirror_index_url",
            f"{shown(index)} is not a plain http(s) URL",
            f"use http(s)://host[:port]/path, e.g. {DEFAULTS['site_cache_mirror_index_url']}",
        )
    upstream = s["site_cache_upstream"]
    if upstream != "" and (not isinstance(upstream, str) or not _URL.fullmatch(upstream)):
        fail(
            "site_cache_upstream",
            f"{shown(upstream)} is not a plain http(s) URL",
            'use "" (vllm_image\'s registry) or http(s)://host[:port], e.g. "https://registry-1.docker.io"',
        )
    address = s["site_cache_address"]
    if address not in ("", "off") and (
        not isinstance(address, str)
        or not _CACHE_ADDRESS.fullmatch(address)
        or not 1 <= int(address.rpartition(":")[2]) <= 65535
    ):
        fail(
            "site_cache_address",
            f"{shown(address)} is not host:port",
            'use "" (the inventory\'s site_cache host), "off", or e.g. "10.0.0.5:5001"',
        )
    for key in ("site_cache_pull_timeout_s", "vllm_fetch_timeout_s"):
        timeout = s[key]
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not_finite(timeout) or timeout <= 0:
            fail(key, f"{shown(timeout)} is not a positive number of seconds", f"e.g. {DEFAULTS[key]}")
