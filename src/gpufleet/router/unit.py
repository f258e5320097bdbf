"""The router's systemd unit (templates/vllm-router.service.j2) and its front door's nginx site
(templates/vllm-router-nginx.conf.j2), with the njs script that keys sessions there (templates/vllm-router-session-key.js)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpufleet.names import url_host
from gpufleet.quoting import systemd_exec
from gpufleet.router.spec import RouterSpec
from gpufleet.units import render_template

NGINX_SITES = "/etc/nginx/conf.d"
# Debian's own site (a welcome page on port 80): a router host serves nothing but its front door.
NGINX_DEFAULT_SITE = "/etc/nginx/sites-enabled/default"
NGINX_SCRIPTS = "/etc/nginx/gpufleet"
# Debian's njs for nginx (bookworm 0.7.9, trixie 0.8.9, Ubuntu 24.04 0.8.2): its package enables the module itself.
NJS_PACKAGE = "libnginx-mod-http-js"


@dataclass(frozen=True)
class SessionKey:
    """How the front door keys a request that names no session: an njs module, and the body it reads in memory."""

    module: str  # njs module name, also the nginx variable holding the key
    script: str  # the module's file on the router host
    buffer: str = "8m"  # client_body_buffer_size: bodies up to this are keyed by their content


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{service}.service"


def proxy_path(service: str) -> str:
    return f"{NGINX_SITES}/gpufleet-{service}.conf"


def script_path(service: str, scripts: str = NGINX_SCRIPTS) -> str:
    return f"{scripts}/{service}-session-key.js"


def session_key(spec: RouterSpec, scripts: str = NGINX_SCRIPTS) -> SessionKey | None:
    """The front door's session key, for a policy that places by X-Session-ID; None for the others."""
    if not spec.keys_sessions:
        return None
    module = f"gpufleet_{re.sub(r'[^A-Za-z0-9_]', '_', spec.service)}_session"
    return SessionKey(module, script_path(spec.service, scripts))


def render_session_script() -> str:
    return render_template("vllm-router-session-key.js")


def render_unit(spec: RouterSpec) -> str:
    return render_template("vllm-router.service.j2", spec=spec, exec_start=systemd_exec(spec.argv()),
                           fence=systemd_exec(spec.fence_argv()), rejoin=systemd_exec(spec.rejoin_argv()))


def render_proxy(spec: RouterSpec, scripts: str = NGINX_SCRIPTS) -> str:
    """The nginx site in front of the router: the client port passes on the client API only (`scripts`: where its
    session key script is)."""
    listen = str(spec.port) if spec.address == "0.0.0.0" else f"{url_host(spec.address)}:{spec.port}"
    return render_template("vllm-router-nginx.conf.j2", spec=spec, listen=listen,
                           session_key=session_key(spec, scripts))
