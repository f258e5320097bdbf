"""Router host data to RouterSpec, and the replicas it routes to; each problem one line (host, setting, fix).

docs/router.md has the settings table.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gpufleet.errors import SettingError, SettingErrors, shown
from gpufleet.names import url_host
from gpufleet.router import wheels
from gpufleet.router.spec import RouterSpec
from gpufleet.vllm.group import headless_ranks
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.value_rules import control_character

DEFAULTS: dict[str, Any] = {
    # Clients' port: nginx passes on the client API only.
    "router_port": 8000,
    "router_address": "0.0.0.0",
    # vllm-router's own port, on the loopback, fenced to root and nginx.
    "router_internal_port": 28000,
    # docs/router.md compares the policies, measured.
    "router_policy": "sticky_least_loaded",
    # Locked, and installed with exactly the lock's wheels.
    "router_version": "0.1.17",
    # PEP 503 index; a mirror works, since pip checks each wheel's sha256.
    "router_index_url": "https://pypi.org/simple",
    "router_venv": "/opt/vllm-router",
    "router_service": "vllm-router",
    # On the router host's loopback.
    "router_metrics_port": 29000,
    # Seconds between the router's /health checks of each worker.
    "router_health_check_interval_s": 10,
    # Seconds the router waits for a worker's /health when it is added.
    "router_worker_startup_timeout_s": 120,
    # Seconds the deploy waits for a (re)started router.
    "router_ready_timeout": 180,
    # On a replica: the address the router reaches it at (worker_url chooses when None).
    "router_worker_address": None,
}
POLICIES = ("cache_aware", "sticky_least_loaded", "consistent_hash", "round_robin", "power_of_two", "random")
_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?(\.post[0-9]+)?(\.dev[0-9]+)?")
_SERVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_ROUTER_KEYS = tuple(k for k in DEFAULTS if k != "router_worker_address")


@dataclass(frozen=True)
class Replica:
    """A vLLM host the router may route to."""

    name: str
    url: str
    data: Mapping[str, Any]


def router_settings(host_data: Mapping[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS, **{k: v for k, v in host_data.items() if k in DEFAULTS}}


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterSettings:
    """A router host's settings once validated: one field per router_* key of DEFAULTS but router_worker_address."""

    port: int
    address: str
    internal_port: int
    policy: str
    version: str
    index_url: str
    venv: str  # without a trailing slash
    service: str
    metrics_port: int
    health_check_interval_s: int
    worker_startup_timeout_s: int
    ready_timeout: int

    def spec(self, host: str, workers: Sequence[str]) -> RouterSpec:
        return RouterSpec(
            host=host,
            service=self.service,
            venv=self.venv,
            version=self.version,
            index_url=self.index_url,
            address=self.address,
            port=self.port,
            metrics_port=self.metrics_port,
            internal_port=self.internal_port,
            policy=self.policy,
            workers=tuple(workers),
            health_check_interval_s=self.health_check_interval_s,
            worker_startup_timeout_s=self.worker_startup_timeout_s,
        )


def build_router_spec(host: str, host_data: Mapping[str, Any], workers: Sequence[str]) -> RouterSpec:
    """Validated RouterSpec for a router host; SettingErrors for bad settings."""
    return resolve_router(host, host_data).spec(host, workers)


def resolve_router(host: str, host_data: Mapping[str, Any]) -> RouterSettings:
    """A router host's validated settings; SettingErrors listing every problem."""
    errors: list[SettingError] = []

    def fail(setting: str, problem: str, fix: str) -> None:
        errors.append(SettingError(host, setting, problem, fix))

    for key in host_data:
        if isinstance(key, str) and key.startswith("router_") and key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            fail(key, "unknown setting", f"did you mean {close[0]}?" if close else "see docs/router.md")
    s = router_settings(host_data)
    for key in _ROUTER_KEYS:
        if isinstance(s[key], str) and control_character(s[key]):
            fail(key, "holds a control character", "remove it")
    for key in ("router_port", "router_internal_port", "router_metrics_port"):
        if not _port(s[key]):
            fail(key, f"{shown(s[key])} is not a TCP port", "use a number from 1 to 65535")
    if _port(s["router_port"]) and s["router_port"] == s["router_metrics_port"]:
        fail("router_metrics_port", "is the same as router_port", "use another port")
    if _port(s["router_internal_port"]) and s["router_internal_port"] in (s["router_port"], s["router_metrics_port"]):
        fail("router_internal_port", "is the same as router_port or router_metrics_port", "use another port")
    for key in ("router_health_check_interval_s", "router_worker_startup_timeout_s", "router_ready_timeout"):
        if not (isinstance(s[key], int) and not isinstance(s[key], bool) and s[key] > 0):
            fail(key, f"{shown(s[key])} is not a positive whole number of seconds", "use e.g. 10")
    if s["router_policy"] not in POLICIES:
        fail(
            "router_policy",
            f"{shown(s['router_policy'])} is not a policy gpufleet runs",
            f"use one of {', '.join(POLICIES)}",
        )
    if not (isinstance(s["router_version"], str) and _VERSION.fullmatch(s["router_version"])):
        fail("router_version", f"{shown(s['router_version'])} is not a release version", 'set one, e.g. "0.1.17"')
    elif s["router_version"] not in wheels.releases():
        fail(
            "router_version",
            f"{s['router_version']} is not in gpufleet's lock of router wheels ({wheels.LOCK_SHOWN} "
            f"has {', '.join(wheels.releases())})",
            f"choose a locked version, or lock it: {wheels.REGENERATE} --version {s['router_version']} (docs/router.md)",
        )
    url = urlsplit(s["router_index_url"]) if isinstance(s["router_index_url"], str) else None
    if url is None or url.scheme not in ("http", "https") or not url.hostname or " " in s["router_index_url"]:
        fail(
            "router_index_url",
            f"{shown(s['router_index_url'])} is not an http(s) URL",
            'use a PEP 503 index such as "https://pypi.org/simple"',
        )
    venv = s["router_venv"]
    if not (
        isinstance(venv, str)
        and venv.startswith("/")
        and venv.rstrip("/") not in ("", "/usr", "/opt", "/etc")
        and ".." not in venv.split("/")
        and re.fullmatch(r"[A-Za-z0-9_./+-]+", venv)
    ):
        fail(
            "router_venv",
            f"{shown(venv)} is not a directory of its own",
            'use an absolute path like "/opt/vllm-router"',
        )
    if not (isinstance(s["router_service"], str) and _SERVICE.fullmatch(s["router_service"])):
        fail(
            "router_service",
            f"{shown(s['router_service'])} is not a unit name",
            'use letters, digits and "-", e.g. "vllm-router"',
        )
    address = s["router_address"]
    if not _ip(address):
        fail(
            "router_address", f"{shown(address)} is not an IP address", 'use "0.0.0.0" (every interface) or one address'
        )
    if errors:
        raise SettingErrors(errors)
    return RouterSettings(
        port=s["router_port"],
        address=address,
        internal_port=s["router_internal_port"],
        policy=s["router_policy"],
        version=s["router_version"],
        index_url=s["router_index_url"],
        venv=venv.rstrip("/"),
        service=s["router_service"],
        metrics_port=s["router_metrics_port"],
        health_check_interval_s=s["router_health_check_interval_s"],
        worker_startup_timeout_s=s["router_worker_startup_timeout_s"],
        ready_timeout=s["router_ready_timeout"],
    )


def worker_url(name: str, data: Mapping[str, Any]) -> str:
    """The URL the router reaches a replica at; SettingError when it cannot (docs/router.md, A worker's address)."""
    s = merged_settings(data)
    port = s["vllm_port"]
    chosen = data.get("router_worker_address")
    publish = s["vllm_publish_address"]
    if chosen is None and publish is not None:
        ip = _ip(publish)
        if ip is not None and ip.is_loopback:
            raise SettingError(
                name,
                "vllm_publish_address",
                f"{publish} keeps vLLM off the network, so no router can reach it",
                "set it to None or to an address the router reaches, or leave this host out of the router's inventory",
            )
        if ip is not None and not ip.is_unspecified:
            chosen = publish
    if chosen is None:
        chosen = data.get("ssh_hostname") or name
    if not (isinstance(chosen, str) and (_ip(chosen) or _HOSTNAME.fullmatch(chosen))):
        raise SettingError(
            name,
            "router_worker_address",
            f"{shown(chosen)} is not a host name or IP address",
            "set router_worker_address to the address the router reaches this host at",
        )
    return f"http://{url_host(chosen)}:{port}"


def replicas(
    hosts: Sequence[tuple[str, Mapping[str, Any]]], orders: Mapping[str, Sequence[str]] | None = None
) -> list[Replica]:
    """The replicas among the inventory's non-router hosts, each with its URL, less the headless ranks of a replica
    group; SettingErrors naming every replica the router cannot address."""
    found, errors = [], []
    skip = headless_ranks(hosts, orders, merged_settings) if orders else set()
    for name, data in hosts:
        if name in skip:
            continue
        try:
            found.append(Replica(name, worker_url(name, data), data))
        except SettingError as error:
            errors.append(error)
    if errors:
        raise SettingErrors(errors)
    return found


def _port(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


def _ip(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value) if isinstance(value, str) else None
    except ValueError:
        return None
