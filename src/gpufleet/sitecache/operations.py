"""The site cache: Debian's docker-registry as a pull-through cache of the image's registry, on the host the
inventory names (group `site_cache`), so a site downloads each layer from upstream once (docs/site-cache.md).

On the cache host: the package, its config (proxy mode: clients can only pull) on the loopback, its service running
as the package runs it, its storage emptied when over site_cache_max_gb; nginx in front on site_cache_port, passing
on only the inventory's hosts' pulls by digest of its repositories. On every host that pulls through it: the
cache's address in Docker's `insecure-registries` (daemon.json, other keys kept), loaded by `systemctl reload docker`
(SIGHUP: dockerd re-reads insecure-registries; running containers are not touched).

Why plain HTTP: every pull through the cache is by digest, and docker checks the manifest and every layer against
that digest, so the transport adds no integrity; what a LAN observer could read is a public image. TLS would mean a
CA (or certificate) to issue, renew and install into every host's /etc/docker/certs.d for nothing docker does not
already check.
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
from gpufleet.sitecache.facts import CONFIG, FRONT, NGINX_DEFAULT_SITE, PACKAGE, UNIT, SiteCacheHost
from gpufleet.units import render_template, unit_path
from gpufleet.wheel_lock import LockedInstall

SITE_CACHE_GROUP = "site_cache"
# Docker Hub's registry API lives at registry-1.docker.io; docker names it docker.io.
HUB_URL = "https://registry-1.docker.io"
STORAGE = "/var/lib/docker-registry"  # the package's own (owned by its user)
CONTENT = f"{STORAGE}/docker"  # what the registry keeps there (emptied when over site_cache_max_gb)
KIB_PER_GB = 1024 * 1024


def upstream_url(image: str) -> str:
    """The registry `image` comes from, as a URL the cache proxies: "vllm/vllm-openai:nightly" ->
    "https://registry-1.docker.io", "reg.example:5000/x/y:t" -> "https://reg.example:5000"."""
    ref = parse(image)
    repository = ref.repository if ref else image
    first = repository.split("/", 1)[0]
    if "/" in repository and ("." in first or ":" in first or first == "localhost"):
        return f"https://{first}"
    return HUB_URL


def registry_host(url: str) -> str:
    """host[:port] of a registry URL; Docker Hub's names all read as registry-1.docker.io."""
    netloc = urlsplit(url).netloc.lower()
    return "registry-1.docker.io" if netloc in ("docker.io", "index.docker.io", "registry-1.docker.io") else netloc


def repository_path(image: str) -> str:
    """The repository's path inside its registry, as the cache serves it: Docker Hub's official images live under
    library/ ("ubuntu" -> "library/ubuntu"), another registry's first component is its host."""
    ref = parse(image)
    repository = ref.repository if ref else image.split("@", 1)[0].rsplit(":", 1)[0]
    first, _, rest = repository.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return rest
    return repository if "/" in repository else f"library/{repository}"


def render_config(upstream: str, port: int) -> str:
    """The cache's config.yml (distribution 2.8's format), listening on the loopback at `port` (nginx in front).
    `proxy.remoteurl` makes it a read-only pull-through cache of one registry; the rest is the package's own default
    (its htpasswd auth left out: clients only pull)."""
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
def serving(seen: SiteCacheHost, upstream: str, port: int, used_kib: int | None = None,
            max_gb: float | None = None) -> Commands:
    """Run the site cache: docker-registry installed, its config proxying `upstream` on the loopback's `port`, its
    service enabled and running (restarted when the config changed); emptied when it holds (used_kib) over max_gb.
    `seen`: the host as SiteCacheFact read it this run.

        site_cache.serving(seen=host.get_fact(SiteCacheFact), upstream="https://registry-1.docker.io", port=5002)
    """
    config = render_config(upstream, port)
    changed = False
    if not seen.installed:
        # The package's postinst starts it with its default config; the restart below loads this one.
        # Decided from `seen` (one fact for the whole cache), not from apt's own facts; conffiles: ours stands.
        yield StringCommand("apt-get", "update", "-q")
        yield StringCommand("DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q",
                            "--no-install-recommends", "-o", "Dpkg::Options::=--force-confold", PACKAGE)
        changed = True
    if seen.config_sha256 != sha256(config):
        yield StringCommand("install", "-d", "-m", "755", shlex.quote(CONFIG.rpartition("/")[0]))
        yield AtomicUpload(as_io(config), CONFIG, "644")
        changed = True
    if used_kib is not None and max_gb is not None and used_kib > max_gb * KIB_PER_GB:
        # Stopped first: the registry keeps descriptors of what it holds in memory.
        yield StringCommand("systemctl", "stop", UNIT)
        yield StringCommand("rm", "-rf", CONTENT)
        changed = True
    if not seen.enabled:
        yield StringCommand("systemctl", "enable", UNIT)
    if changed or not seen.active:
        yield StringCommand("systemctl", "restart", UNIT)
    if not changed and seen.enabled and seen.active:
        host.noop(f"{PACKAGE} proxies {upstream} on {LOOPBACK}:{port}, enabled and running")


def render_front(port: int, internal_port: int, clients: Sequence[str], repositories: Sequence[str],
                 models: Sequence[str] = (), mirror_port: int | None = None) -> str:
    """nginx's site in front of the cache: `clients` (addresses or networks) pull `repositories` (repository_path)
    by digest, and read `models` (Hugging Face repos) through the model mirror on mirror_port; anything else gets
    403."""
    pattern = "|".join(re.escape(r) for r in sorted(set(repositories)))
    models_pattern = "|".join(re.escape(m) for m in sorted(set(models))) if mirror_port else ""
    return render_template("site-cache-nginx.conf.j2", port=int(port), internal=f"{LOOPBACK}:{int(internal_port)}",
                           clients=sorted(set(clients)), repositories=pattern, models=models_pattern,
                           mirror=f"{LOOPBACK}:{int(mirror_port or 0)}")


@operation()
def front_door(seen: SiteCacheHost, port: int, internal_port: int, clients: Sequence[str],
               repositories: Sequence[str], models: Sequence[str] = (), mirror_port: int | None = None) -> Commands:
    """nginx on site_cache_port in front of the cache (render_front): installed, its site written when it differs,
    checked, reloaded."""
    content = render_front(port, internal_port, clients, repositories, models, mirror_port)
    changed = seen.front_sha256 != sha256(content)
    if seen.nginx and not changed and seen.nginx_active:
        host.noop(f"nginx passes the inventory's pulls on to the site cache on port {port}, and nothing else")
        return
    if not seen.nginx:
        yield StringCommand("apt-get", "update", "-q")
        yield StringCommand("DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q",
                            "--no-install-recommends", "nginx")
        yield StringCommand("rm", "-f", NGINX_DEFAULT_SITE)  # installed by this run: nothing of the host's
    if changed:
        yield AtomicUpload(as_io(content), FRONT, "644")
    # A site nginx refuses is not loaded: the running nginx keeps serving what it had.
    yield StringCommand("nginx", "-t", "-q")
    yield StringCommand("systemctl", "enable", "nginx")
    yield StringCommand("systemctl", "reload-or-restart", "nginx")


def _refuse(state: State, target: Host, why: str) -> bool:
    return fail(target, why)


@operation()
def model_mirror(seen: SiteCacheHost, install: LockedInstall | str, config: str, index_url: str, port: int
                 ) -> Commands:
    """The model mirror (gpufleet.sitecache.mirror): the lock's wheels in a venv of their own (switched to by one
    rename), its config and unit, enabled and running on the loopback's `port`; restarted when any of them changed,
    then waited for. install: why not, when the lock has no wheels for the host."""
    if isinstance(install, str):
        yield FunctionCommand(_refuse, (install,), {})
        return
    changed = False
    if seen.mirror_key != install.key:
        if not seen.python3_venv:
            yield from apt.packages._inner(packages=["python3-venv"], update=True, no_recommends=True)
        target = shlex.quote(mirror.venv_dir(install))
        # A venv left by a cut or failed install of this entry is made again from nothing.
        yield StringCommand("sh", "-c", shlex.quote(f"install -d -m 755 {mirror.HOME} && rm -rf {target} && "
                                                    f"python3 -m venv {target}"))
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
        # Hosts download through it right after this run's next operations: it must listen first (~3 s).
        url = shlex.quote(f"http://{LOOPBACK}:{int(port)}/")
        yield StringCommand("sh", "-c", shlex.quote(
            f"i=0; until curl -s -o /dev/null --max-time 3 {url}; do i=$((i+1)); if [ $i -ge 60 ]; then "
            f"echo 'the model mirror did not answer within 60 s (journalctl -u {mirror.UNIT})' >&2; exit 1; fi; "
            "sleep 1; done"))
    elif seen.mirror_enabled:
        host.noop(f"{install.describe()} mirrors the hub for the inventory's models, enabled and running")


@dataclass(frozen=True)
class CachePull:
    """How a host pulls through its site cache: the cache's address and the cache host's name (for the warning
    line), the repository's path on the cache, and a bound on the pull through it."""

    address: str  # host:port
    cache_host: str
    path: str
    timeout_s: float
    on_this_host: bool = False  # the pulling host runs the cache (it can see the cache's storage)

    def ref(self, digest: str) -> str:
        return f"{self.address}/{self.path}@{digest}"


@dataclass(frozen=True)
class ModelMirror:
    """Where a host downloads the model through: the site cache's mirror of the hub (olah behind its nginx, on the
    same port as the image cache), and the cache host's name (for the warning line)."""

    endpoint: str  # http://host:port
    cache_host: str
