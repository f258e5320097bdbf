"""The router's systemd unit (templates/vllm-router.service.j2) and its front door's nginx site
(templates/vllm-router-nginx.conf.j2)."""

from __future__ import annotations

from gpufleet.names import url_host
from gpufleet.quoting import systemd_exec
from gpufleet.router.spec import RouterSpec
from gpufleet.units import render_template

NGINX_SITES = "/etc/nginx/conf.d"
# Debian's own site (a welcome page on port 80): a router host serves nothing but its front door.
NGINX_DEFAULT_SITE = "/etc/nginx/sites-enabled/default"


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{service}.service"


def proxy_path(service: str) -> str:
    return f"{NGINX_SITES}/gpufleet-{service}.conf"


def render_unit(spec: RouterSpec) -> str:
    return render_template("vllm-router.service.j2", spec=spec, exec_start=systemd_exec(spec.argv()),
                           fence=systemd_exec(spec.fence_argv()), rejoin=systemd_exec(spec.rejoin_argv()))


def render_proxy(spec: RouterSpec) -> str:
    """The nginx site in front of the router: the client port passes on the client API only."""
    listen = str(spec.port) if spec.address == "0.0.0.0" else f"{url_host(spec.address)}:{spec.port}"
    return render_template("vllm-router-nginx.conf.j2", spec=spec, listen=listen)
