"""The router's front door as the deploy renders it (nginx config and session key script), run by this machine's
nginx on loopback in front of a router (or any upstream) on a local port, for tests and the bench."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpufleet.router.settings import build_router_spec
from gpufleet.router.unit import render_proxy, render_session_script, session_key
from tests.ports import free_port

# Debian's njs module (libnginx-mod-http-js); its modules-enabled line names it relative to nginx's own prefix.
NJS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")


def missing() -> str | None:
    """Why this machine cannot run the front door, or None."""
    if not shutil.which("nginx"):
        return "no nginx on this machine"
    if not NJS_MODULE.exists():
        return f"no {NJS_MODULE} (apt install libnginx-mod-http-js)"
    return None


def expected_key(body: dict) -> str:
    """The key the front door's script derives for a chat body: the system prompt and the messages up to the first
    user message, as JSON.stringify writes them, hashed, in 16 bits."""
    head: list = [body.get("system"), body.get("instructions")]
    for message in body["messages"]:
        head.append([message.get("role"), message.get("content")])
        if message.get("role") == "user":
            break
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False)
    return "gf-" + hashlib.sha256(text.encode()).hexdigest()[:4]


def nginx_conf(site: str, work: Path) -> str:
    """A whole nginx.conf around a site of the deploy's, everything nginx writes kept in `work`."""
    temp = " ".join(f"{kind}_temp_path {work}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    # Its workers as root too (when the master is), so they write body files in `work` whoever owns it.
    return (
        f"load_module {NJS_MODULE}; user root; daemon off; pid {work}/nginx.pid; error_log {work}/error.log; "
        f"events {{}} http {{ access_log off; {temp}\n{site}\n}}\n"
    )


class FrontDoor:
    """nginx serving the deploy's site for `policy` on a free loopback port, passing on to `upstream_port`."""

    def __init__(self, policy: str, upstream_port: int, work: Path | None = None):
        self.work = work or Path(tempfile.mkdtemp(prefix="fd-", dir="/tmp"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        spec = build_router_spec(
            "frontdoor",
            {
                "router_policy": policy,
                "router_address": "127.0.0.1",
                "router_port": self.port,
                "router_internal_port": upstream_port,
            },
            (),
        )
        key = session_key(spec, str(self.work))
        if key is not None:
            Path(key.script).write_text(render_session_script())
        conf = self.work / "nginx.conf"
        conf.write_text(nginx_conf(render_proxy(spec, str(self.work)), self.work))
        with (self.work / "stderr").open("wb") as stderr:
            self.proc = subprocess.Popen(
                ["nginx", "-c", str(conf), "-p", str(self.work)],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.base}/nothing-here", timeout=1)
            except urllib.error.HTTPError:
                return  # nginx's own 404: it listens
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not start: {self.errors()}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def errors(self) -> str:
        logs = (self.work / name for name in ("stderr", "error.log"))
        return "".join(log.read_text() for log in logs if log.exists())[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
