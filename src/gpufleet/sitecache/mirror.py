"""The site cache's mirror of the Hugging Face hub: olah, from a lock of hashed wheels (docs/site-cache.md).

Regenerate the lock when bumping OLAH_VERSION: python -m gpufleet.sitecache.mirror
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from gpufleet import wheel_lock
from gpufleet.names import LOOPBACK

OLAH_VERSION = "0.5.4"
# psutil<6 (olah's requirement) has no aarch64 wheels.
MACHINES = ("x86_64",)
LOCK = wheel_lock.LockFile(
    "olah",
    Path(__file__).resolve().parents[1] / "data" / "olah-lock.json",
    "src/gpufleet/data/olah-lock.json",
    "python -m gpufleet.sitecache.mirror",
    "site_cache",
    "docs/site-cache.md",
)
SERVICE = "gpufleet-model-mirror"
UNIT = f"{SERVICE}.service"
HOME = f"/opt/{SERVICE}"  # a venv per lock entry; the unit runs `current`
CONFIG = f"/etc/gpufleet/{SERVICE}.toml"
STATE = f"/var/lib/{SERVICE}"
MARKER = ".gpufleet-installed"  # holds the lock entry's key once every wheel is in
REQUIREMENTS = "gpufleet-requirements.txt"


def locked(host: str, python: str | None, machine: str | None) -> wheel_lock.LockedInstall:
    """SettingError when the lock has no wheels for the host's Python."""
    return wheel_lock.locked_install(LOCK, host, OLAH_VERSION, python, machine)


def venv_dir(install: wheel_lock.LockedInstall) -> str:
    return f"{HOME}/{install.key[:16]}"


def upstream(hub: str) -> tuple[str, str, str]:
    """olah's hf-scheme, hf-netloc and hf-lfs-netloc for the hub URL."""
    url = urlsplit(hub)
    netloc = url.netloc
    return url.scheme, netloc, "cdn-lfs.huggingface.co" if netloc == "huggingface.co" else netloc


def render_config(
    hub: str, port: int, address: str, repositories: Sequence[str], max_gb: float, state: str = STATE
) -> str:
    """olah's config, mirroring only `repositories`; `address`: where hosts reach it."""
    scheme, netloc, lfs = upstream(hub)
    rules = "".join(f'  {{ repo = "{r}", allow = true, use_re = false }},\n' for r in sorted(set(repositories)))
    deny = '  { repo = "*", allow = false, use_re = false },\n  { repo = "*/*", allow = false, use_re = false },\n'
    return f"""# Managed by gpufleet: the site cache's mirror of {hub} (docs/site-cache.md)
[basic]
host = "{LOOPBACK}"
port = {int(port)}
repos-path = "{state}/repos"
cache-size-limit = "{max(1, int(max_gb))}GB"
cache-clean-strategy = "LRU"
cache-redirect-model = false
xet-passthrough = false
hf-scheme = "{scheme}"
hf-netloc = "{netloc}"
hf-lfs-netloc = "{lfs}"
mirror-scheme = "http"
mirror-netloc = "{address}"
mirror-lfs-netloc = "{address}"

[accessibility]
offline = false
proxy = [
{deny}{rules}]
cache = [
{deny}{rules}]
"""


# olah imports GitPython, which refuses to load without git; no git mirror is configured.
NO_GIT = "GIT_PYTHON_REFRESH=quiet"


def render_unit() -> str:
    return f"""# Managed by gpufleet: the site cache's mirror of the Hugging Face hub (docs/site-cache.md)
[Unit]
Description=gpufleet model mirror (olah) for the site cache
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
DynamicUser=yes
StateDirectory={SERVICE}
WorkingDirectory={STATE}
Environment=HOME={STATE} HF_HUB_DISABLE_TELEMETRY=1 {NO_GIT}
ExecStart={HOME}/current/bin/olah-cli -c {CONFIG}
Restart=on-failure
RestartSec=2
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""


def pip_install_argv(target: str, index_url: str) -> list[str]:
    return wheel_lock.pip_install_argv(target, index_url, f"{target}/{REQUIREMENTS}")


def install_script(install: wheel_lock.LockedInstall, index_url: str) -> str:
    """Shell filling a new venv, then switching `current` to it by one rename."""
    target = venv_dir(install)
    q = shlex.quote
    pip = " ".join(map(q, pip_install_argv(target, index_url)))
    return (
        f"{pip} && {NO_GIT} {q(target)}/bin/python -c 'import olah.server' && "
        f"printf '%s\\n' {install.key} > {q(target)}/{MARKER} && "
        f"ln -sfn {q(target)} {HOME}/current.tmp && mv -T {HOME}/current.tmp {HOME}/current"
    )


if __name__ == "__main__":
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = sorted({*wheel_lock.PYTHONS, here}, key=lambda v: tuple(map(int, v.split("."))))
    lock = wheel_lock.generate(LOCK, [OLAH_VERSION], pythons, MACHINES)
    problems = wheel_lock.check(LOCK.package, lock)
    if problems:
        sys.exit("\n".join(problems))
    wheel_lock.write(lock, LOCK.path)
    print(f"wrote {LOCK.path}")
