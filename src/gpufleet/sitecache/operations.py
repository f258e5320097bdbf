"""The site cache's operations: the registry, the nginx in front of it, the model mirror (docs/site-cache.md).

Plain HTTP on purpose: every pull is by digest, which docker checks, so TLS would add no integrity.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.image_names import parse
from gpufleet.names import LOOPBACK
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import AtomicUpload, as_io, sha256
from gpufleet.sitecache import mirror
from gpufleet.sitecache.facts import CONFIG, FRONT, NGINX_DEFAULT_CONFIG, PACKAGE, UNIT, SiteCacheHost
from gpufleet.units import render_template, unit_path
from gpufleet.wheel_lock import LockedInstall

SITE_CACHE_GROUP = "site_cache"
HUB_URL = "https://registry-1.docker.io"
STORAGE = "/var/lib/docker-registry"  # the package's own
CONTENT = f"{STORAGE}/docker"
KIB_PER_GB = 1024 * 1024


def upstream_url(image: str) -> str:
    ref = parse(image)
    repository = ref.repository if ref else image
    first = repository.split("/", 1)[0]
    if "/" in repository and ("." in first or ":" in first or first == "localhost"):
        return f"https://{first}"
    return HUB_URL


def registry_host(url: str) -> str:
    """host[:port] of a registry URL, Docker Hub's under one name."""
    netloc = urlsplit(url).netloc.lower()
    return "registry-1.docker.io" if netloc in ("docker.io", "index.docker.io", "registry-1.docker.io") else netloc


def repository_path(image: str) -> str:
    """The repository's path inside its registry: "ubuntu" -> "library/ubuntu", "reg:5000/x/y" -> "x/y"."""
    ref = parse(image)
    repository = ref.repository if ref else image.split("@", 1)[0].rsplit(":", 1)[0]
    first, _, rest = repository.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return rest
    return repository if "/" in repository else f"library/{repository}"


def render_config(upstream: str, port: int) -> str:
    """The registry's config.yml: a pull-through cache of `upstream`."""
    return f"""# Managed by gpufleet: the site cache, a pull-through cache of {upstream} (docs/site-cache.md)
version: 0.1
log:
  fields:
    service: registry
storage:
  cache:
    blobdescriptor: inmemory
  filesystem:
    rootdirectory: {STORAGE}
http:
  addr: {LOOPBACK}:{int(port)}
  headers:
    X-Content-Type-Options: [nosniff]
proxy:
  remoteurl: {upstream}
health:
  storagedriver:
    enabled: true
    interval: 10s
    threshold: 3
"""


@operation()
def serving(
    seen: SiteCacheHost, upstream: str, port: int, used_kib: int | None = None, max_gb: float | None = None
) -> Commands:
    """Run the registry proxying `upstream` on the loopback's `port`, emptied when used_kib is over max_gb."""
    config = render_config(upstream, port)
    changed = False
    if not seen.installed:
        # postinst starts it on its default config; the restart below loads ours, which --force-confold keeps.
        yield StringCommand("apt-get", "update", "-q")
        yield StringCommand(
            "DEBIAN_FRONTEND=noninteractive",
            "apt-get",
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "-o",
            "Dpkg::Options::=--force-confold",
            PACKAGE,
        )
        changed = True
    if seen.config_sha256 != sha256(config):
        yield StringCommand("install", "-d", "-m", "755", shlex.quote(CONFIG.rpartition("/")[0]))
        yield AtomicUpload(as_io(config), CONFIG, "644")
        changed = True
    if used_kib is not None and max_gb is not None and used_kib > max_gb * KIB_PER_GB:
        # Stopped first: the registry caches descriptors of its blobs in memory.
        yield StringCommand("systemctl", "stop", UNIT)
        yield StringCommand("rm", "-rf", CONTENT)
        changed = True
    if not seen.enabled:
        yield StringCommand("systemctl", "enable", UNIT)
    if changed or not seen.active:
        yield StringCommand("systemctl", "restart", UNIT)
    if not changed and seen.enabled and seen.active:
        host.noop(f"{PACKAGE} proxies {upstream} on {LOOPBACK}:{port}, enabled and running")


def render_front(
    port: int,
    internal_port: int,
    clients: Sequence[str],
    repositories: Sequence[str],
    models: Sequence[str] = (),
    mirror_port: int | None = None,
) -> str:
    """nginx's config: `clients` pull `repositories` by digest and read `models`; all else is 403."""
    pattern = "|".join(re.escape(r) for r in sorted(set(repositories)))
    models_pattern = "|".join(re.escape(m) for m in sorted(set(models))) if mirror_port else ""
    return render_template(
        "site-cache-nginx.conf.j2",
        port=int(port),
        internal=f"{LOOPBACK}:{int(internal_port)}",
        clients=sorted(set(clients)),
        repositories=pattern,
        models=models_pattern,
        mirror=f"{LOOPBACK}:{int(mirror_port or 0)}",
    )


@operation()
def front_door(
    seen: SiteCacheHost,
    port: int,
    internal_port: int,
    clients: Sequence[str],
    repositories: Sequence[str],
    models: Sequence[str] = (),
    mirror_port: int | None = None,
) -> Commands:
    """Run nginx on `port` in front of the cache and the mirror."""
    content = render_front(port, internal_port, clients, repositories, models, mirror_port)
    changed = seen.front_sha256 != sha256(content)
    if seen.nginx and not changed and seen.nginx_active:
        host.noop(f"nginx passes the inventory's pulls on to the site cache on port {port}, and nothing else")
        return
    if not seen.nginx:
        yield StringCommand("apt-get", "update", "-q")
        yield StringCommand(
            "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx"
        )
        yield StringCommand("rm", "-f", NGINX_DEFAULT_CONFIG)  # this run installed nginx: its default is not the host's
    if changed:
        yield AtomicUpload(as_io(content), FRONT, "644")
    # A site nginx refuses is never loaded.
    yield StringCommand("nginx", "-t", "-q")
    yield StringCommand("systemctl", "enable", "nginx")
    yield StringCommand("systemctl", "reload-or-restart", "nginx")


def _refuse(state: State, target: Host, why: str) -> bool:
    return fail(target, why)


@operation()
def model_mirror(seen: SiteCacheHost, install: LockedInstall | str, config: str, index_url: str, port: int) -> Commands:
    """Run the model mirror on the loopback's `port`; `install` is a str saying why not when there is no lock."""
    if isinstance(install, str):
        yield FunctionCommand(_refuse, (install,), {})
        return
    changed = False
    if seen.mirror_key != install.key:
        if not seen.python3_venv:
            yield from apt.packages._inner(packages=["python3-venv"], update=True, no_recommends=True)
        target = shlex.quote(mirror.venv_dir(install))
        # A venv left by a failed install of this entry is made again.
        yield StringCommand(
            "sh", "-c", shlex.quote(f"install -d -m 755 {mirror.HOME} && rm -rf {target} && python3 -m venv {target}")
        )
        yield AtomicUpload(as_io(install.requirements()), f"{mirror.venv_dir(install)}/{mirror.REQUIREMENTS}", "644")
        yield StringCommand("sh", "-c", shlex.quote(mirror.install_script(install, index_url)))
        changed = True
    if seen.mirror_config_sha256 != sha256(config):
        yield StringCommand("install", "-d", "-m", "755", shlex.quote(mirror.CONFIG.rpartition("/")[0]))
        yield AtomicUpload(as_io(config), mirror.CONFIG, "644")
        changed = True
    unit = mirror.render_unit()
    if seen.mirror_unit_sha256 != sha256(unit):
        yield AtomicUpload(as_io(unit), unit_path(mirror.SERVICE), "644")
        yield StringCommand("systemctl", "daemon-reload")
        changed = True
    if not seen.mirror_enabled:
        yield StringCommand("systemctl", "enable", mirror.UNIT)
    if changed or not seen.mirror_active:
        yield StringCommand("systemctl", "restart", mirror.UNIT)
        # Wait until it listens: hosts download through it next.
        url = shlex.quote(f"http://{LOOPBACK}:{int(port)}/")
        yield StringCommand(
            "sh",
            "-c",
            shlex.quote(
                f"i=0; until curl -s -o /dev/null --max-time 3 {url}; do i=$((i+1)); if [ $i -ge 60 ]; then "
                f"echo 'the model mirror did not answer within 60 s (journalctl -u {mirror.UNIT})' >&2; exit 1; fi; "
                "sleep 1; done"
            ),
        )
    elif seen.mirror_enabled:
        host.noop(f"{install.describe()} mirrors the hub for the inventory's models, enabled and running")


@dataclass(frozen=True)
class CachePull:
    address: str  # host:port
    cache_host: str
    path: str
    timeout_s: float
    on_this_host: bool = False  # the pulling host runs the cache

    def ref(self, digest: str) -> str:
        return f"{self.address}/{self.path}@{digest}"


@dataclass(frozen=True)
class ModelMirror:
    endpoint: str  # http://host:port
    cache_host: str
