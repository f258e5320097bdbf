"""A replica group: hosts that serve one model together on vLLM's multi-node engine (docs/multi-node.md). Here: the
group read from the inventory and checked across its hosts, and what each rank adds to its spec and ledger.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import SettingError, shown

GROUP_SETTING = "vllm_group"
# One engine is built from each rank's own flags, over one model at one path.
SHARED_SETTINGS = (
    "vllm_profile",
    "vllm_image",
    "vllm_model",
    "vllm_model_repo",
    "vllm_model_revision",
    "vllm_args",
    "vllm_service",
    "vllm_port",
    "vllm_group_port",
    "vllm_api_key",
)
OWNED_FLAGS = {
    "nnodes": GROUP_SETTING,
    "node-rank": GROUP_SETTING,
    "headless": GROUP_SETTING,
    "master-addr": "vllm_group_address",
    "master-port": "vllm_group_port",
    "distributed-executor-backend": GROUP_SETTING,
}
# Gloo and NCCL pick a wrong interface unless told; vLLM advertises VLLM_HOST_IP.
OWNED_ENV = {
    "VLLM_HOST_IP": "vllm_group_address",
    "GLOO_SOCKET_IFNAME": "vllm_group_interface",
    "NCCL_SOCKET_IFNAME": "vllm_group_interface",
}
_INTERFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}")


@dataclass(frozen=True)
class Member:
    """One host's place in its group; tuples are in rank order."""

    group: str
    rank: int
    hosts: tuple[str, ...]
    addresses: tuple[str, ...]  # on the group's network (VLLM_HOST_IP)
    port: int  # the head's master port
    interface: str | None
    spec_hashes: tuple[str, ...] = ()  # every rank's spec hash (rank order), once all were built

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def address(self) -> str:
        return self.addresses[self.rank]

    @property
    def peers(self) -> tuple[str, ...]:
        """The addresses this rank watches: the others from the head, the head from a rank."""
        return self.addresses[1:] if self.is_head else self.addresses[:1]

    def args(self) -> dict[str, bool | str]:
        """vLLM's multi-node flags for this rank (mp executor: no Ray cluster to run)."""
        args: dict[str, bool | str] = {
            "distributed-executor-backend": "mp",
            "nnodes": str(len(self.hosts)),
            "node-rank": str(self.rank),
            "master-addr": self.addresses[0],
            "master-port": str(self.port),
        }
        return args if self.is_head else {**args, "headless": True}

    def env(self) -> dict[str, str]:
        sockets = {"GLOO_SOCKET_IFNAME": self.interface, "NCCL_SOCKET_IFNAME": self.interface} if self.interface else {}
        return {"VLLM_HOST_IP": self.address, **sockets}

    def version(self, image_ref: str, model: str | None = None) -> str:
        """ "<group>@<16 hex>" of the digest, the model's commit and every rank's spec hash, as each ledger names it."""
        canonical = json.dumps([image_ref, list(self.spec_hashes), *([model] if model else [])], separators=(",", ":"))
        return f"{self.group}@{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


# The group read from the inventory, checked across its hosts
def members(
    vllm_hosts: Sequence[tuple[str, Mapping[str, Any]]], orders: Mapping[str, Sequence[str]], merged: Any
) -> tuple[dict[str, Member], list[SettingError]]:
    """{host: Member} for every host in a group, and one SettingError per problem. orders: each inventory group's
    hosts in order; merged: gpufleet.vllm.settings.merged_settings, over raw host data."""
    settings = {name: merged(data) for name, data in vllm_hosts}
    data = dict(vllm_hosts)
    errors: list[SettingError] = []
    named: dict[str, list[str]] = {}
    for name, s in settings.items():
        group = s[GROUP_SETTING]
        if group is None:
            continue
        if not isinstance(group, str) or group not in orders or name not in orders[group]:
            errors.append(
                SettingError(
                    name,
                    GROUP_SETTING,
                    f"{shown(group)} is no inventory group holding this host",
                    "set vllm_group in the data of the group whose hosts serve one model together, "
                    "to that group's name",
                )
            )
            continue
        named.setdefault(group, []).append(name)
    found: dict[str, Member] = {}
    for group in named:
        ranks = [h for h in orders[group] if h in settings]
        for h in ranks:
            if settings[h][GROUP_SETTING] != group:
                errors.append(
                    SettingError(
                        h,
                        GROUP_SETTING,
                        f"is {shown(settings[h][GROUP_SETTING])}, but the host is "
                        f"in group {group}, whose other hosts serve one model together",
                        f'set vllm_group = "{group}" in the group\'s data, not per host',
                    )
                )
        if len(ranks) < 2:
            errors.append(
                SettingError(
                    ranks[0],
                    GROUP_SETTING,
                    f"group {group} has one host",
                    "list at least two hosts in the group, or remove vllm_group",
                )
            )
            continue
        problems = _check_group(group, ranks, settings, data)
        errors += problems
        if problems:
            continue
        addresses = tuple(_address(settings[h], data[h]) or "" for h in ranks)
        for rank, h in enumerate(ranks):
            found[h] = Member(
                group,
                rank,
                tuple(ranks),
                addresses,
                settings[h]["vllm_group_port"],
                settings[h]["vllm_group_interface"],
            )
    return found, errors


def headless_ranks(
    vllm_hosts: Sequence[tuple[str, Mapping[str, Any]]], orders: Mapping[str, Sequence[str]], merged: Any
) -> set[str]:
    """The hosts that serve no API: every rank but the head."""
    out = set()
    for name, data in vllm_hosts:
        group = merged(data).get(GROUP_SETTING)
        hosts = orders.get(group) if isinstance(group, str) else None
        if hosts and name in hosts and hosts[0] != name:
            out.add(name)
    return out


def _address(s: Mapping[str, Any], data: Mapping[str, Any]) -> str | None:
    value = s["vllm_group_address"]
    if value is None:
        value = data.get("ssh_hostname")
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else None
    except ValueError:
        return None


def _check_group(
    group: str, ranks: Sequence[str], settings: Mapping[str, Mapping[str, Any]], data: Mapping[str, Mapping[str, Any]]
) -> list[SettingError]:
    errors: list[SettingError] = []
    head = ranks[0]
    for h in ranks:
        s = settings[h]
        port = s["vllm_group_port"]
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535 or port == s["vllm_port"]:
            errors.append(
                SettingError(
                    h,
                    "vllm_group_port",
                    f"{shown(port)} is not a free TCP port beside vllm_port",
                    "use a port from 1 to 65535 other than vllm_port, e.g. 29501",
                )
            )
        interface = s["vllm_group_interface"]
        if interface is not None and (not isinstance(interface, str) or not _INTERFACE.fullmatch(interface)):
            errors.append(
                SettingError(
                    h,
                    "vllm_group_interface",
                    f"{shown(interface)} is not an interface name",
                    'use the name `ip -br addr` shows on the host, e.g. "enp65s0", or None',
                )
            )
        if _address(s, data[h]) is None:
            given = s["vllm_group_address"]
            errors.append(
                SettingError(
                    h,
                    "vllm_group_address",
                    f"{shown(given)} is not an IP address"
                    if given is not None
                    else "is None and ssh_hostname is not an IP address",
                    "set the host's IP address on the group's network, e.g. \"10.0.0.12\"",
                )
            )
        if s["vllm_publish_address"] is not None:
            errors.append(
                SettingError(
                    h,
                    "vllm_publish_address",
                    "a group's ranks run with host networking: nothing is published",
                    "remove it; the head's API listens where vllm_args host says",
                )
            )
        link = s["vllm_group_link"]
        if link is not None and (not isinstance(link, str) or not link or len(link) > 80):
            errors.append(
                SettingError(
                    h,
                    "vllm_group_link",
                    f"{shown(link)} is not a short description",
                    'e.g. "25GbE" or "100GbE RoCE", or None',
                )
            )
        if h == head:
            continue
        for key in SHARED_SETTINGS:
            if s[key] != settings[head][key]:
                shown_value = "(not shown)" if key == "vllm_api_key" else shown(s[key])
                errors.append(
                    SettingError(
                        h,
                        key,
                        f"{shown_value} differs from the head {head}'s: every rank of group {group} runs one engine",
                        "set it in the group's data, so every rank has the same",
                    )
                )
        gpus, head_gpus = s["vllm_gpus"], settings[head]["vllm_gpus"]
        if isinstance(gpus, (list, tuple)) and isinstance(head_gpus, (list, tuple)) and len(gpus) != len(head_gpus):
            errors.append(
                SettingError(
                    h,
                    "vllm_gpus",
                    f"lists {len(gpus)} GPU(s), the head {head} {len(head_gpus)}: "
                    "every rank holds the same share of the model",
                    f"list {len(head_gpus)} GPU(s) on every rank",
                )
            )
    addresses = [_address(settings[h], data[h]) for h in ranks]
    for h, address in zip(ranks, addresses, strict=True):
        if address is not None and addresses.count(address) > 1:
            errors.append(
                SettingError(
                    h,
                    "vllm_group_address",
                    f"{address} is another rank's address too",
                    "give each rank its own address on the group's network",
                )
            )
    return errors


def check_member_settings(member: Member, s: Mapping[str, Any], fail: Any) -> None:
    """What a rank's own settings may not set: the flags, environment and networking the group owns."""
    for key in s["vllm_args"] if isinstance(s["vllm_args"], Mapping) else ():
        name = str(key).lstrip("-").replace("_", "-")
        if name in OWNED_FLAGS:
            fail(
                f"vllm_args[{key!r}]",
                f"group {member.group} sets --{name} on each rank",
                f"remove it; set {OWNED_FLAGS[name]} instead",
            )
    for key in s["vllm_env"] if isinstance(s["vllm_env"], Mapping) else ():
        if key in OWNED_ENV:
            fail(
                f"vllm_env[{key!r}]",
                f"group {member.group} sets {key} on each rank",
                f"remove it; set {OWNED_ENV[key]} instead",
            )
    for key in s["vllm_docker_options"] if isinstance(s["vllm_docker_options"], Mapping) else ():
        if str(key).lstrip("-") in ("network", "net"):
            fail(
                f"vllm_docker_options[{key!r}]",
                f"group {member.group}'s ranks run with host networking (vLLM's "
                "ranks reach each other on ports they pick at start)",
                "remove it",
            )
