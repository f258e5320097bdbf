"""What the site cache host has (Debian's docker-registry: package, config, systemd's view), in one command.

Read only on the inventory's `site_cache` hosts, by the deploy, once per run: the host snapshot
(gpufleet.vllm.facts) reads what every vLLM host needs, and one host's cache is not that.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pyinfra.api import FactBase

PACKAGE = "docker-registry"
UNIT = "docker-registry.service"
CONFIG = "/etc/docker/registry/config.yml"  # where Debian's package (and its unit) read the configuration


@dataclass(frozen=True)
class SiteCacheHost:
    installed: bool = False
    config_sha256: str | None = None
    active: bool = False
    enabled: bool = False


def command() -> str:
    q = shlex.quote
    return (f"echo installed=$(dpkg-query -W -f='${{db:Status-Abbrev}}' {PACKAGE} 2>/dev/null); "
            f"echo config=$(sha256sum {q(CONFIG)} 2>/dev/null | cut -d' ' -f1); "
            f"echo active=$(systemctl is-active {UNIT} 2>/dev/null); "
            f"echo enabled=$(systemctl is-enabled {UNIT} 2>/dev/null); true")


def parse(lines: list[str]) -> SiteCacheHost:
    """
    >>> parse(["installed=ii ", "config=", "active=inactive", "enabled=enabled"])
    SiteCacheHost(installed=True, config_sha256=None, active=False, enabled=True)
    """
    fields = dict(line.strip().partition("=")[::2] for line in lines if "=" in line)
    return SiteCacheHost(installed=fields.get("installed", "").startswith("ii"),
                         config_sha256=fields.get("config") or None,
                         active=fields.get("active") == "active", enabled=fields.get("enabled") == "enabled")


class SiteCacheFact(FactBase[SiteCacheHost]):
    """The site cache's package, config checksum and unit state."""

    def command(self) -> str:
        return command()

    @staticmethod
    def default() -> SiteCacheHost:
        return SiteCacheHost()

    def process(self, output: list[str]) -> SiteCacheHost:
        return parse(output)
