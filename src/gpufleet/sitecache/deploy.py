"""The site cache's part of the vLLM deploy (docs/site-cache.md): run it on the inventory's `site_cache` host, and
tell every host how to pull through it. The vLLM deploy calls both before its pull."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from typing import Protocol

from pyinfra.api import Host, Inventory

from gpufleet.defaults import DEFAULTS
from gpufleet.errors import SettingError, SettingErrors
from gpufleet.inventory import ROUTERS_GROUP
from gpufleet.names import LOOPBACK
from gpufleet.sitecache import mirror
from gpufleet.sitecache import operations as site_cache
from gpufleet.sitecache.facts import SiteCacheFact
from gpufleet.sitecache.operations import (
    SITE_CACHE_GROUP,
    CachePull,
    ModelMirror,
    registry_host,
    repository_path,
    upstream_url,
)
from gpufleet.wheel_lock import LockedInstall


class CacheSettings(Protocol):
    """The settings of a vLLM host the site cache reads (gpufleet.vllm.settings.VllmSettings)."""

    @property
    def model_repo(self) -> str | None: ...
    @property
    def hf_endpoint(self) -> str: ...
    @property
    def site_cache_port(self) -> int: ...
    @property
    def site_cache_internal_port(self) -> int: ...
    @property
    def site_cache_clients(self) -> tuple[str, ...]: ...
    @property
    def site_cache_max_gb(self) -> float: ...
    @property
    def site_cache_upstream(self) -> str: ...
    @property
    def site_cache_address(self) -> str: ...
    @property
    def site_cache_mirror_port(self) -> int: ...
    @property
    def site_cache_model_max_gb(self) -> float: ...
    @property
    def site_cache_mirror_index_url(self) -> str: ...
    @property
    def site_cache_pull_timeout_s(self) -> float: ...


def cache_hosts(target: Host) -> list[Host]:
    """The inventory's site cache hosts (the first one serves the site)."""
    return list(target.inventory.get_group(SITE_CACHE_GROUP, []))


def upstream(settings: CacheSettings, image: str) -> str:
    return settings.site_cache_upstream or upstream_url(image)


def cache_pull(target: Host, settings: CacheSettings, image: str) -> CachePull | None:
    """How `target` pulls `image` through the site cache; None when none serves the image's registry."""
    address = settings.site_cache_address
    if address == "off":
        return None
    caches = cache_hosts(target)
    if not address:
        if not caches:
            return None
        first = caches[0]
        where = first.data.get("ssh_hostname") or first.name
        address = f"{where}:{first.data.get('site_cache_port', DEFAULTS['site_cache_port'])}"
        cache_host = first.name
        # What the cache host proxies: its own site_cache_upstream, else its own vllm_image's registry.
        proxied = first.data.get("site_cache_upstream") or upstream_url(
            first.data.get("vllm_image", DEFAULTS["vllm_image"])
        )
    else:
        cache_host = address.rpartition(":")[0]
        proxied = upstream(settings, image)
    if registry_host(proxied) != registry_host(upstream_url(image)):
        return None
    return CachePull(
        address=address,
        cache_host=cache_host,
        path=repository_path(image),
        timeout_s=float(settings.site_cache_pull_timeout_s),
        on_this_host=cache_host == target.name,
    )


def model_mirror(target: Host, settings: CacheSettings) -> ModelMirror | None:
    """Where `target` downloads the model through, or None: no site cache, "off", another site's cache, or a cache
    host on another hub."""
    caches = cache_hosts(target)
    if settings.site_cache_address or not caches or not settings.model_repo:
        return None
    first = caches[0]
    if (first.data.get("vllm_hf_endpoint") or DEFAULTS["vllm_hf_endpoint"]) != settings.hf_endpoint:
        return None
    where = first.data.get("ssh_hostname") or first.name
    return ModelMirror(
        endpoint=f"http://{where}:{first.data.get('site_cache_port', DEFAULTS['site_cache_port'])}",
        cache_host=first.name,
    )


def check_port(inventory: Inventory, name: str, settings: CacheSettings, vllm_port: int) -> None:
    """Raise SettingErrors when `name` is a site cache host whose ports take vllm_port, or whose clients() fail."""
    if not any(h.name == name for h in inventory.get_group(SITE_CACHE_GROUP, [])):
        return
    for key, port in (
        ("site_cache_port", settings.site_cache_port),
        ("site_cache_internal_port", settings.site_cache_internal_port),
    ):
        if port == vllm_port:
            raise SettingErrors(
                [
                    SettingError(
                        name,
                        key,
                        f"{port} is vllm_port too on this site cache host",
                        f"set another port for one of them, e.g. {key} {DEFAULTS[key]}",
                    )
                ]
            )
    clients(inventory, settings.site_cache_clients)


def _pullers(inventory: Inventory) -> list[Host]:
    return [h for h in inventory if ROUTERS_GROUP not in h.groups]  # every host, whatever --limit selects


def clients(inventory: Inventory, extra: Sequence[str]) -> list[str]:
    """Who may pull through the cache: the loopback, `extra` and each vLLM host's ssh_hostname, resolved here."""
    found, errors = [LOOPBACK, "::1", *extra], []
    for h in _pullers(inventory):
        where = str(h.data.get("ssh_hostname") or h.name)
        try:
            found.append(str(ipaddress.ip_address(where)))
        except ValueError:
            try:
                found += sorted({str(info[4][0]) for info in socket.getaddrinfo(where, None)})
            except OSError as error:
                errors.append(
                    SettingError(
                        h.name,
                        "ssh_hostname",
                        f"{where} does not resolve ({error.strerror}), so the site cache cannot let it pull",
                        "set ssh_hostname to its address, or add it to site_cache_clients",
                    )
                )
    if errors:
        raise SettingErrors(errors)
    return found


def repositories(inventory: Inventory, proxied: str) -> list[str]:
    """The paths on the cache of the repositories the inventory's vLLM hosts run from the registry it proxies."""
    images = [str(h.data.get("vllm_image") or DEFAULTS["vllm_image"]) for h in _pullers(inventory)]
    return [repository_path(i) for i in images if registry_host(upstream_url(i)) == registry_host(proxied)]


def serves_site(target: Host) -> bool:
    caches = cache_hosts(target)
    return bool(caches) and caches[0].name == target.name


def deploy_site_cache(
    target: Host, settings: CacheSettings, image: str, used_kib: int | None, *, models: Sequence[str] = ()
) -> None:
    """On the site cache host: docker-registry proxying the image's registry, under site_cache_max_gb (used_kib: what
    it holds now); olah mirroring the hub for `models`; nginx in front of both."""
    seen = target.get_fact(SiteCacheFact)
    proxied = upstream(settings, image)
    internal = settings.site_cache_internal_port
    site_cache.serving(
        name="Run the site cache (docker-registry as a pull-through cache)",
        seen=seen,
        upstream=proxied,
        port=internal,
        used_kib=used_kib,
        max_gb=float(settings.site_cache_max_gb),
    )
    mirror_port = settings.site_cache_mirror_port
    if models:
        try:
            install: LockedInstall | str = mirror.locked(target.name, seen.python, seen.machine)
        except SettingError as error:
            install = str(error)
        where = target.data.get("ssh_hostname") or target.name
        config = mirror.render_config(
            settings.hf_endpoint,
            mirror_port,
            f"{where}:{settings.site_cache_port}",
            models,
            float(settings.site_cache_model_max_gb),
        )
        site_cache.model_mirror(
            name="Mirror the hub for the inventory's models (olah, from hashed wheels)",
            seen=seen,
            install=install,
            config=config,
            index_url=settings.site_cache_mirror_index_url,
            port=mirror_port,
        )
    site_cache.front_door(
        name="Serve the site cache to the inventory's hosts and repositories (nginx)",
        seen=seen,
        port=settings.site_cache_port,
        internal_port=internal,
        clients=clients(target.inventory, settings.site_cache_clients),
        repositories=repositories(target.inventory, proxied),
        models=models,
        mirror_port=mirror_port if models else None,
    )
