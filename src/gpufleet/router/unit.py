"""The router's systemd unit, and its front door's nginx config and session key script."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpufleet.names import url_host
from gpufleet.quoting import systemd_exec
from gpufleet.router.spec import RouterSpec
from gpufleet.units import render_template

NGINX_SITES = "/etc/nginx/conf.d"
# A router host serves nothing but its front door.
NGINX_DEFAULT_CONFIG = "/etc/nginx/sites-enabled/default"
NGINX_SCRIPTS = "/etc/nginx/gpufleet"
# Its package enables the module itself.
NJS_PACKAGE = "libnginx-mod-http-js"


@dataclass(frozen=True)
class SessionKey:
    """How the front door keys a request that names no session."""

    module: str  # also the nginx variable holding the key
    script: str
    buffer: str = "8m"  # bodies up to this are keyed by content


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{service}.service"


def proxy_path(service: str) -> str:
    return f"{NGINX_SITES}/gpufleet-{service}.conf"


def script_path(service: str, scripts: str = NGINX_SCRIPTS) -> str:
    return f"{scripts}/{service}-session-key.js"


def session_key(spec: RouterSpec, scripts: str = NGINX_SCRIPTS) -> SessionKey | None:
    """For a policy that places by X-Session-ID."""
    if not spec.keys_sessions:
        return None
    module = f"gpufleet_{re.sub(r'[^A-Za-z0-9_]', '_', spec.service)}_session"
    return SessionKey(module, script_path(spec.service, scripts))


def render_session_script() -> str:
    return render_template("vllm-router-session-key.js")


def render_unit(spec: RouterSpec) -> str:
    return render_template(
        "vllm-router.service.j2",
        spec=spec,
        exec_start=systemd_exec(spec.argv()),
        fence=systemd_exec(spec.fence_argv()),
        rejoin=systemd_exec(spec.rejoin_argv()),
    )


def render_proxy(spec: RouterSpec, scripts: str = NGINX_SCRIPTS) -> str:
    """The nginx config that passes on the client API only."""
    listen = str(spec.port) if spec.address == "0.0.0.0" else f"{url_host(spec.address)}:{spec.port}"
    return render_template(
        "vllm-router-nginx.conf.j2", spec=spec, listen=listen, session_key=session_key(spec, scripts)
    )
