"""What the site cache host has (Debian's docker-registry and the nginx in front of it: packages, configs, systemd's
view), in one command.

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
FRONT = "/etc/nginx/conf.d/gpufleet-site-cache.conf"  # nginx in front of it (gpufleet.sitecache.operations)
NGINX_DEFAULT_SITE = "/etc/nginx/sites-enabled/default"  # Debian's welcome page, on port 80


@dataclass(frozen=True)
class SiteCacheHost:
    installed: bool = False
    config_sha256: str | None = None
    active: bool = False
    enabled: bool = False
    nginx: bool = False  # Debian's nginx is installed
    front_sha256: str | None = None
    nginx_active: bool = False


def command() -> str:
    q = shlex.quote
    return (f"echo installed=$(dpkg-query -W -f='${{db:Status-Abbrev}}' {PACKAGE} 2>/dev/null); "
            f"echo config=$(sha256sum {q(CONFIG)} 2>/dev/null | cut -d' ' -f1); "
            f"echo active=$(systemctl is-active {UNIT} 2>/dev/null); "
            f"echo enabled=$(systemctl is-enabled {UNIT} 2>/dev/null); "
            f"echo nginx=$(dpkg-query -W -f='${{db:Status-Abbrev}}' nginx 2>/dev/null); "
            f"echo front=$(sha256sum {q(FRONT)} 2>/dev/null | cut -d' ' -f1); "
            "echo nginx_active=$(systemctl is-active nginx 2>/dev/null); true")


def parse(lines: list[str]) -> SiteCacheHost:
    """
    >>> seen = parse(["installed=ii ", "config=", "active=inactive", "enabled=enabled", "nginx=un "])
    >>> seen.installed, seen.config_sha256, seen.active, seen.enabled, seen.nginx
    (True, None, False, True, False)
    """
    fields = dict(line.strip().partition("=")[::2] for line in lines if "=" in line)
    return SiteCacheHost(installed=fields.get("installed", "").startswith("ii"),
                         config_sha256=fields.get("config") or None,
                         active=fields.get("active") == "active", enabled=fields.get("enabled") == "enabled",
                         nginx=fields.get("nginx", "").startswith("ii"), front_sha256=fields.get("front") or None,
                         nginx_active=fields.get("nginx_active") == "active")


class SiteCacheFact(FactBase[SiteCacheHost]):
    """The site cache's package, config checksum and unit state."""

    def command(self) -> str:
        return command()

    @staticmethod
    def default() -> SiteCacheHost:
        return SiteCacheHost()

    def process(self, output: list[str]) -> SiteCacheHost:
        return parse(output)
