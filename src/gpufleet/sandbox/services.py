"""The fleet's local services on the bridge address: a static HTTP server for the mirror and repos, a registry and
the stand-in hub, each started by PID and recorded in the state file."""

from __future__ import annotations

import re
import shutil
import sys
import urllib.request
from pathlib import Path

from gpufleet.sandbox import hub, procs
from gpufleet.sandbox.config import HUB_PORT, MIRROR_PORT, REGISTRY_PORT, FleetConfig
from gpufleet.sandbox.state import State


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def _wait_serving(state: State, name: str, url: str, address: str) -> None:
    """Wait until OUR process answers; an answer while it died means someone else holds the address."""

    def ready() -> bool:
        if not state.live_pid(name):
            raise procs.SandboxError(f"the {name} could not start: is {address} used by another process?")
        return _answers(url)

    procs.wait_for(ready, 20, f"the {name} on {address}")


def serve_files(cfg: FleetConfig, state: State, tree: dict[str, Path]) -> None:
    """Serve tree (URL prefix -> directory) at http://<gateway>:8080/<prefix>/."""
    www = cfg.state_dir / "www"
    www.mkdir(parents=True, exist_ok=True)
    for name, target in tree.items():
        link = www / name
        if link.is_symlink() and link.resolve() != target.resolve():
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(target)
    if not state.live_pid("mirror"):
        pid = procs.spawn(
            [sys.executable, "-m", "http.server", str(MIRROR_PORT), "--bind", cfg.gateway, "--directory", str(www)],
            cfg.state_dir / "logs" / "mirror.log",
        )
        state.add_pid("mirror", pid)
    _wait_serving(state, "mirror", f"{cfg.mirror_url}/", f"{cfg.gateway}:{MIRROR_PORT}")


def hub_root(cfg: FleetConfig) -> Path:
    return cfg.state_dir / "hub"


def hub_log(cfg: FleetConfig) -> Path:
    return cfg.state_dir / "logs" / "hub.log"


def serve_hub(cfg: FleetConfig, state: State, model: Path, repo: str) -> None:
    """The stand-in Hugging Face hub at http://<gateway>:8081, its `repo` holding `model` as the one commit on main."""
    shutil.rmtree(hub_root(cfg), ignore_errors=True)
    hub.publish(hub_root(cfg), repo, {p.name: p for p in model.iterdir() if p.is_file()})
    if not state.live_pid("hub"):
        pid = procs.spawn(
            [
                sys.executable,
                "-m",
                "gpufleet.sandbox.hub",
                str(hub_root(cfg)),
                "--bind",
                cfg.gateway,
                "--port",
                str(HUB_PORT),
                "--log",
                str(hub_log(cfg)),
            ],
            cfg.state_dir / "logs" / "hub.out",
        )
        state.add_pid("hub", pid)
    _wait_serving(state, "hub", f"{cfg.hub_url}/api/models/{repo}", f"{cfg.gateway}:{HUB_PORT}")


def registry_storage(cfg: FleetConfig) -> Path:
    return cfg.cache_dir / f"registry-{cfg.name}"


def serve_registry(cfg: FleetConfig, state: State) -> None:
    conf = cfg.state_dir / "registry.yml"
    conf.write_text(f"""version: 0.1
log: {{level: warn}}
storage: {{filesystem: {{rootdirectory: {registry_storage(cfg)}}}, delete: {{enabled: true}}}}
http: {{addr: "{cfg.gateway}:{REGISTRY_PORT}"}}
""")
    if not state.live_pid("registry"):
        pid = procs.spawn(["docker-registry", "serve", str(conf)], cfg.state_dir / "logs" / "registry.log")
        state.add_pid("registry", pid)
    _wait_serving(state, "registry", f"http://{cfg.registry}/v2/", cfg.registry)


def registry_log(cfg: FleetConfig) -> Path:
    """The fleet registry's access log, one line per request."""
    return cfg.state_dir / "logs" / "registry.log"


# 10.213.6.11 - - [01/Dec/2026:05:34:00 +0000] "GET /v2/vllm/vllm-openai/blobs/sha256:... HTTP/1.1" 200 1234 ...
_ACCESS = re.compile(
    r'^(?P<ip>\S+) \S+ \S+ \[[^\]]+\] "(?P<method>\S+) (?P<path>\S+) [^"]*" (?P<status>\d+) '
    r"(?P<bytes>\d+|-)"
)


def log_offset(cfg: FleetConfig) -> int:
    """Where the registry's log ends now, for blob_bytes(since=...)."""
    path = registry_log(cfg)
    return path.stat().st_size if path.exists() else 0


def blob_bytes(cfg: FleetConfig, since: int = 0) -> dict[str, int]:
    """Client address -> bytes of blobs the registry served it after log offset `since`."""
    path = registry_log(cfg)
    if not path.exists():
        return {}
    with path.open("rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    served: dict[str, int] = {}
    for line in text.splitlines():
        m = _ACCESS.match(line)
        if m and m["method"] == "GET" and "/blobs/" in m["path"] and m["bytes"] != "-":
            served[m["ip"]] = served.get(m["ip"], 0) + int(m["bytes"])
    return served
