"""What is on a router host, read in one command, including whether each candidate worker answers /health there."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from gpufleet.router.spec import MARKER, NFT, RouterSpec, fence_table
from gpufleet.router.unit import NGINX_DEFAULT_CONFIG, NJS_PACKAGE, proxy_path, script_path, unit_path


@dataclass(frozen=True)
class RouterHost:
    installed_version: str | None = None
    python3_venv: bool = False  # Debian's package
    python: str | None = None  # "3.11", else apt's candidate for python3
    machine: str | None = None  # uname -m
    venv_link: str | None = None  # router_venv's target
    venv_previous: str | None = None  # in use before the last switch
    venv_legacy: bool = False  # router_venv is a directory from before the lock
    # <router_venv>.venvs/<name> to the lock key it holds; "" when its install never finished.
    venvs: dict[str, str] = field(default_factory=dict)
    unit_sha256: str | None = None
    members_sha256: str | None = None
    active_state: str | None = None
    need_daemon_reload: bool = False
    enabled: bool = False
    live_workers: tuple[str, ...] | None = None  # None when the router does not answer
    reach: dict[str, str] = field(default_factory=dict)  # worker URL to its /health's HTTP code
    nginx: bool = False
    proxy_sha256: str | None = None  # of the front door's nginx config
    default_config: bool = False
    nginx_active: bool = False
    njs: bool = False
    session_script_sha256: str | None = None
    nftables: bool = False
    fenced: bool = False

    @property
    def running(self) -> bool:
        return self.active_state == "active"

    @property
    def venv_key(self) -> str | None:
        """The lock key of the complete venv the router runs from."""
        if self.venv_link is None:
            return None
        return self.venvs.get(self.venv_link.rstrip("/").rpartition("/")[2]) or None


def venv_lines(spec: RouterSpec) -> list[str]:
    """The shell lines that read the host's Python and machine, and its venvs."""
    venv, venvs = shlex.quote(spec.venv), shlex.quote(spec.venvs_dir)
    return [
        'echo "python=$(python3 -c \'import sys; print("%d.%d" % sys.version_info[:2])\' 2>/dev/null)"',
        "command -v python3 >/dev/null || "
        "echo \"python_candidate=$(apt-cache policy python3 2>/dev/null | sed -n 's/^ *Candidate: *//p')\"",
        'echo "machine=$(uname -m)"',
        f'test -L {venv} && echo "venv_link=$(readlink {venv})"',
        f"test -d {venv} && ! test -L {venv} && echo venv_legacy=yes",
        f'test -L {venvs}/previous && echo "venv_previous=$(readlink {venvs}/previous)"',
        f'for d in {venvs}/*/; do n=${{d%/}}; test -d "$d" && ! test -L "$n" && '
        f'echo "venvs ${{n##*/}} $(cat "${{d}}{MARKER}" 2>/dev/null)"; done',
    ]


def command(spec: RouterSpec, candidates: tuple[str, ...]) -> str:
    venv, unit = shlex.quote(spec.venv), shlex.quote(unit_path(spec.service))
    lines = [
        *venv_lines(spec),
        f"for d in {venv}/lib/python3*/site-packages/vllm_router-*.dist-info; do "
        'test -d "$d" && echo "dist=${d##*/}"; done',
        "echo \"python3_venv=$(dpkg-query -W -f='${Status}' python3-venv 2>/dev/null | tr ' ' _)\"",
        f"echo \"unit_sha256=$(sha256sum {unit} 2>/dev/null | cut -d' ' -f1)\"",
        f"echo \"members_sha256=$(sha256sum {shlex.quote(spec.members_file)} 2>/dev/null | cut -d' ' -f1)\"",
        f"systemctl show {shlex.quote(spec.service + '.service')} -p ActiveState -p NeedDaemonReload -p UnitFileState "
        "2>/dev/null",
        f"echo \"workers=$(curl -sS --max-time 3 {shlex.quote(spec.control_url + '/list_workers')} 2>/dev/null | tr -d '\\n')\"",
        "echo \"nginx=$(dpkg-query -W -f='${Status}' nginx 2>/dev/null | tr ' ' _)\"",
        f"echo \"proxy_sha256=$(sha256sum {shlex.quote(proxy_path(spec.service))} 2>/dev/null | cut -d' ' -f1)\"",
        f"test -e {NGINX_DEFAULT_CONFIG} && echo default_config=yes",
        'echo "nginx_active=$(systemctl is-active nginx 2>/dev/null)"',
        f"echo \"njs=$(dpkg-query -W -f='${{Status}}' {NJS_PACKAGE} 2>/dev/null | tr ' ' _)\"",
        f"echo \"session_script_sha256=$(sha256sum {shlex.quote(script_path(spec.service))} 2>/dev/null | cut -d' ' -f1)\"",
        "echo \"nftables=$(dpkg-query -W -f='${Status}' nftables 2>/dev/null | tr ' ' _)\"",
        f"{NFT} list table inet {fence_table(spec.internal_port)} >/dev/null 2>&1 && echo fenced=yes",
    ]
    for url in candidates:
        lines.append(
            f"echo reach {shlex.quote(url)} \"$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 "
            f'{shlex.quote(url + "/health")})"'
        )
    return "; ".join(lines) + "; true"


def parse(output: list[str]) -> RouterHost:
    values: dict[str, str] = {}
    reach: dict[str, str] = {}
    venvs: dict[str, str] = {}
    for line in output:
        if line.startswith("venvs "):
            _, name, *marker = line.split(" ")
            venvs[name] = marker[0] if marker else ""
        elif line.startswith("reach "):
            _, url, *code = line.split(" ")
            reach[url] = code[0] if code else "000"
        elif "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    dist = values.get("dist", "")
    version = dist.removeprefix("vllm_router-").removesuffix(".dist-info") if dist else None
    live: tuple[str, ...] | None = None
    try:
        urls = json.loads(values.get("workers") or "null")
        if isinstance(urls, dict) and isinstance(urls.get("urls"), list):
            live = tuple(str(u) for u in urls["urls"])
    except json.JSONDecodeError:
        live = None
    return RouterHost(
        installed_version=version or None,
        python3_venv=values.get("python3_venv") == "install_ok_installed",
        python=values.get("python") or _minor(values.get("python_candidate", "")),
        machine=values.get("machine") or None,
        venv_link=values.get("venv_link") or None,
        venv_previous=values.get("venv_previous") or None,
        venv_legacy=values.get("venv_legacy") == "yes",
        venvs=venvs,
        unit_sha256=values.get("unit_sha256") or None,
        members_sha256=values.get("members_sha256") or None,
        active_state=values.get("ActiveState") or None,
        need_daemon_reload=values.get("NeedDaemonReload") == "yes",
        enabled=values.get("UnitFileState") == "enabled",
        live_workers=live,
        reach=reach,
        nginx=values.get("nginx") == "install_ok_installed",
        proxy_sha256=values.get("proxy_sha256") or None,
        default_config=values.get("default_config") == "yes",
        nginx_active=values.get("nginx_active") == "active",
        njs=values.get("njs") == "install_ok_installed",
        session_script_sha256=values.get("session_script_sha256") or None,
        nftables=values.get("nftables") == "install_ok_installed",
        fenced=values.get("fenced") == "yes",
    )


def _minor(debian_version: str) -> str | None:
    """ "3.11.2-1+b1" to "3.11"."""
    m = re.match(r"([0-9]+\.[0-9]+)\.", debian_version)
    return m[1] if m else None


class RouterHostFact(FactBase[RouterHost]):
    """Everything the router deploy decides from, in one command."""

    def command(self, spec: RouterSpec, candidates: tuple[str, ...]) -> str:
        return command(spec, candidates)

    @staticmethod
    def default() -> RouterHost:
        return RouterHost()

    def process(self, output: list[str]) -> RouterHost:
        return parse(output)
