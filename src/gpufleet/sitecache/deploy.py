"""The site cache's part of the deploy (docs/site-cache.md): run it on the inventory's `site_cache` host, and tell
every host how to pull through it. The vLLM deploy calls both before its pull: pyinfra runs each operation on every
host before the next one, so the cache is running before any host pulls through it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyinfra.api import Host, Inventory

from gpufleet.defaults import DEFAULTS
from gpufleet.errors import SettingError, SettingErrors
from gpufleet.sitecache import operations as site_cache
from gpufleet.sitecache.facts import SiteCacheFact
from gpufleet.sitecache.operations import SITE_CACHE_GROUP, CachePull, registry_host, repository_path, upstream_url


def cache_hosts(target: Host) -> list[Host]:
    """The inventory's site cache hosts (the first one serves the site)."""
    return list(target.inventory.get_group(SITE_CACHE_GROUP, []))


def upstream(settings: Mapping[str, Any], image: str) -> str:
    return settings["site_cache_upstream"] or upstream_url(image)


def cache_pull(target: Host, settings: Mapping[str, Any], image: str) -> CachePull | None:
    """How `target` pulls `image` through the site cache, or None: none configured, "off", or the cache proxies
    another registry than the image's (one cache proxies one registry)."""
    address = settings["site_cache_address"]
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
        proxied = first.data.get("site_cache_upstream") or upstream_url(first.data.get("vllm_image",
                                                                                       DEFAULTS["vllm_image"]))
    else:
        cache_host = address.rpartition(":")[0]
        proxied = upstream(settings, image)
    if registry_host(proxied) != registry_host(upstream_url(image)):
        return None
    return CachePull(address=address, cache_host=cache_host, path=repository_path(image),
                     timeout_s=float(settings["site_cache_pull_timeout_s"]), on_this_host=cache_host == target.name)


def check_port(inventory: Inventory, name: str, settings: Mapping[str, Any], vllm_port: int) -> None:
    """Raise SettingErrors when `name` is a site cache host whose cache would take vllm_port."""
    port = settings["site_cache_port"]
    if port == vllm_port and any(h.name == name for h in inventory.get_group(SITE_CACHE_GROUP, [])):
        raise SettingErrors([SettingError(name, "site_cache_port", f"{port} is vllm_port too on this site cache host",
                                          "set another port for one of them, e.g. site_cache_port 5001")])


def serves_site(target: Host) -> bool:
    caches = cache_hosts(target)
    return bool(caches) and caches[0].name == target.name


def deploy_site_cache(target: Host, settings: Mapping[str, Any], image: str) -> None:
    """On the site cache host: docker-registry proxying the image's registry, running."""
    seen = target.get_fact(SiteCacheFact)
    site_cache.serving(name="Run the site cache (docker-registry as a pull-through cache)", seen=seen,
                       upstream=upstream(settings, image), port=int(settings["site_cache_port"]))
