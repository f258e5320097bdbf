"""What the site cache host has, in one command; read only on `site_cache` hosts, so not in the host snapshot."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pyinfra.api import FactBase

from gpufleet.sitecache import mirror
from gpufleet.units import unit_path

PACKAGE = "docker-registry"
UNIT = "docker-registry.service"
CONFIG = "/etc/docker/registry/config.yml"  # where Debian's package reads it
FRONT = "/etc/nginx/conf.d/gpufleet-site-cache.conf"
MIRROR_HOME, MIRROR_CONFIG, MIRROR_UNIT, MIRROR_SERVICE = mirror.HOME, mirror.CONFIG, mirror.UNIT, mirror.SERVICE
NGINX_DEFAULT_CONFIG = "/etc/nginx/sites-enabled/default"  # Debian's welcome page, on port 80


@dataclass(frozen=True)
class SiteCacheHost:
    installed: bool = False
    config_sha256: str | None = None
    active: bool = False
    enabled: bool = False
    nginx: bool = False  # installed
    front_sha256: str | None = None
    nginx_active: bool = False
    # the model mirror
    python: str | None = None  # "3.11", else apt's candidate for python3
    machine: str | None = None  # uname -m
    python3_venv: bool = False
    mirror_key: str | None = None  # the lock entry `current` holds whole
    mirror_config_sha256: str | None = None
    mirror_unit_sha256: str | None = None
    mirror_active: bool = False
    mirror_enabled: bool = False


def command() -> str:
    q = shlex.quote
    return (
        f"echo \"installed=$(dpkg-query -W -f='${{db:Status-Abbrev}}' {PACKAGE} 2>/dev/null)\"; "
        f"echo \"config=$(sha256sum {q(CONFIG)} 2>/dev/null | cut -d' ' -f1)\"; "
        f'echo "active=$(systemctl is-active {UNIT} 2>/dev/null)"; '
        f'echo "enabled=$(systemctl is-enabled {UNIT} 2>/dev/null)"; '
        f"echo \"nginx=$(dpkg-query -W -f='${{db:Status-Abbrev}}' nginx 2>/dev/null)\"; "
        f"echo \"front=$(sha256sum {q(FRONT)} 2>/dev/null | cut -d' ' -f1)\"; "
        'echo "nginx_active=$(systemctl is-active nginx 2>/dev/null)"; '
        'echo "python=$(python3 -c \'import sys; print("%d.%d" % sys.version_info[:2])\' 2>/dev/null)"; '
        "command -v python3 >/dev/null || "
        "echo \"python_candidate=$(apt-cache policy python3 2>/dev/null | sed -n 's/^ *Candidate: *//p')\"; "
        'echo "machine=$(uname -m)"; '
        "echo \"python3_venv=$(dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | tr ' ' _)\"; "
        f'echo "mirror_key=$(cat {q(MIRROR_HOME)}/current/{mirror.MARKER} 2>/dev/null)"; '
        f"echo \"mirror_config=$(sha256sum {q(MIRROR_CONFIG)} 2>/dev/null | cut -d' ' -f1)\"; "
        f"echo \"mirror_unit=$(sha256sum {q(unit_path(MIRROR_SERVICE))} 2>/dev/null | cut -d' ' -f1)\"; "
        f'echo "mirror_active=$(systemctl is-active {MIRROR_UNIT} 2>/dev/null)"; '
        f'echo "mirror_enabled=$(systemctl is-enabled {MIRROR_UNIT} 2>/dev/null)"; true'
    )


def parse(lines: list[str]) -> SiteCacheHost:
    fields = dict(line.strip().partition("=")[::2] for line in lines if "=" in line)
    return SiteCacheHost(
        installed=fields.get("installed", "").startswith("ii"),
        config_sha256=fields.get("config") or None,
        active=fields.get("active") == "active",
        enabled=fields.get("enabled") == "enabled",
        nginx=fields.get("nginx", "").startswith("ii"),
        front_sha256=fields.get("front") or None,
        nginx_active=fields.get("nginx_active") == "active",
        python=fields.get("python") or _minor(fields.get("python_candidate", "")),
        machine=fields.get("machine") or None,
        python3_venv=fields.get("python3_venv") == "install_ok_installed",
        mirror_key=fields.get("mirror_key") or None,
        mirror_config_sha256=fields.get("mirror_config") or None,
        mirror_unit_sha256=fields.get("mirror_unit") or None,
        mirror_active=fields.get("mirror_active") == "active",
        mirror_enabled=fields.get("mirror_enabled") == "enabled",
    )


def _minor(candidate: str) -> str | None:
    """ "3.11.2-1+b1" -> "3.11"; None when apt names no candidate."""
    parts = candidate.split(".")
    return f"{parts[0]}.{parts[1]}" if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() else None


class SiteCacheFact(FactBase[SiteCacheHost]):
    def command(self) -> str:
        return command()

    @staticmethod
    def default() -> SiteCacheHost:
        return SiteCacheHost()

    def process(self, output: list[str]) -> SiteCacheHost:
        return parse(output)
