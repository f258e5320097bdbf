"""Readiness and identity: one state per host, each backed by evidence.

The order of evidence matters. A TCP connect proves nothing (docker-proxy accepts on a published port before vLLM
listens, and vLLM binds without listening while it loads), so readiness needs /health 200 AND /v1/models listing
the expected id; only then are the identity checks (max_model_len, cache config labels) meaningful.
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from gpufleet.health.api import HttpStatusError, get, get_json
from gpufleet.health.metrics import KV_USAGE, RUNNING, WAITING, Metrics, parse_metrics
from gpufleet.health.transport import ContainerInfo, Transport, TransportError, Unreachable

# vLLM waits up to VLLM_ENGINE_READY_TIMEOUT_S (600 s) for the engine, after loading weights: past this much time
# a running container that still refuses connections is not "starting" any more.
DEFAULT_GRACE_S = 900.0


class HealthState(StrEnum):
    SSH_UNREACHABLE = "ssh-unreachable"
    CONTAINER_NOT_RUNNING = "container-not-running"
    STARTING = "starting"
    DEAD = "dead"
    MISCONFIGURED = "misconfigured"
    READY = "ready"


@dataclass(frozen=True)
class Expected:
    """What a host should serve, taken from its spec (Expected.from_spec) or written by hand in tests.

    cache_config: vllm:cache_config_info labels that must match exactly, e.g. {"enable_prefix_caching": "True"}.
    """

    service: str
    port: int
    served_model_name: str
    max_model_len: int | None = None
    cache_config: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: Any) -> Expected:
        """From a gpufleet.spec.ServeSpec: the identity the deploy configured."""
        cache = {"enable_prefix_caching": str(bool(spec.prefix_caching))}
        if spec.mamba_cache_mode:
            cache["mamba_cache_mode"] = str(spec.mamba_cache_mode)
        return cls(
            service=spec.service,
            port=int(spec.port),
            served_model_name=spec.served_model_name,
            max_model_len=spec.max_model_len,
            cache_config=cache,
        )


@dataclass(frozen=True)
class HealthReport:
    state: HealthState
    detail: str  # one line: the evidence for the state
    host: str = ""
    version: str | None = None
    served_models: tuple[str, ...] = ()
    max_model_len: int | None = None
    kv_cache_usage: float | None = None  # 0..1
    running: int | None = None
    waiting: int | None = None
    prefix_cache_hit_rate: float | None = None  # cumulative, tokens
    cache_config: dict[str, str] = field(default_factory=dict, repr=False)  # vllm:cache_config_info labels
    container: ContainerInfo | None = None
    logs: tuple[str, ...] = ()  # the container's last lines, attached when wait_until_ready fails
    checked_at: float = field(default_factory=time.time)

    @property
    def ready(self) -> bool:
        return self.state is HealthState.READY

    @property
    def served_model(self) -> str | None:
        return self.served_models[0] if self.served_models else None

    def as_dict(self) -> dict[str, Any]:
        c = self.container
        return {
            "host": self.host,
            "state": str(self.state),
            "detail": self.detail,
            "version": self.version,
            "served_model": self.served_model,
            "max_model_len": self.max_model_len,
            "kv_cache_usage": self.kv_cache_usage,
            "running": self.running,
            "waiting": self.waiting,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "container": None
            if c is None
            else {"id": c.id, "state": c.state, "image": c.image, "image_id": c.image_id, "spec_hash": c.spec_hash},
            "logs": list(self.logs),
        }


# Errors that mean "nothing answered HTTP": a refused tunnel/connect, or a proxy that accepted and hung up.
_NO_LISTENER = (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)


def check(transport: Transport, expected: Expected, grace_s: float = DEFAULT_GRACE_S, api_key: str | None = None) -> HealthReport:
    """One look at the host: container state first, then HTTP, then identity.

    api_key: the server's --api-key (VLLM_API_KEY), needed for /v1/models when it runs with one.
    """
    report = HealthReport(HealthState.STARTING, "", host=transport.name)
    try:
        container = transport.container(expected.service)
    except Unreachable as e:
        return replace(report, state=HealthState.SSH_UNREACHABLE, detail=str(e))
    except TransportError as e:
        return replace(report, state=HealthState.CONTAINER_NOT_RUNNING, detail=f"cannot read container state: {e}")
    report = replace(report, container=container)
    if container is None:
        return replace(
            report,
            state=HealthState.CONTAINER_NOT_RUNNING,
            detail=f"no container labelled gpufleet.{expected.service}",
        )
    if container.state in ("exited", "dead", "restarting"):
        code = "" if container.exit_code is None else f" (exit code {container.exit_code})"
        return replace(report, state=HealthState.DEAD, detail=f"container {container.id} is {container.state}{code}")
    if not container.running:
        return replace(report, state=HealthState.CONTAINER_NOT_RUNNING, detail=f"container {container.id} is {container.state}")
    try:
        return _check_http(transport, expected, report, api_key)
    except Unreachable as e:
        return replace(report, state=HealthState.SSH_UNREACHABLE, detail=str(e))
    except (*_NO_LISTENER, TimeoutError) as e:
        up = time.time() - container.started_at if container.started_at else None
        if up is not None and up > grace_s:
            return replace(
                report,
                state=HealthState.DEAD,
                detail=f"port {expected.port} still not answering {up:.0f} s after start (grace {grace_s:.0f} s)",
            )
        since = f" (up {up:.0f} s)" if up is not None else ""
        return replace(
            report,
            state=HealthState.STARTING,
            detail=f"container running{since}, port {expected.port} not answering yet: {type(e).__name__}",
        )


def _check_http(transport: Transport, expected: Expected, report: HealthReport, api_key: str | None) -> HealthReport:
    port = expected.port
    status, body = get(transport, port, "/health")
    if status != 200:
        # 503 = EngineDeadError: the API server is up but its engine is gone (it exits a few seconds later).
        return replace(report, state=HealthState.DEAD, detail=f"/health answered {status} {body.strip()[:80]}")
    try:
        models = get_json(transport, port, "/v1/models", api_key=api_key)
        version = get_json(transport, port, "/version").get("version")
        metrics = parse_metrics(get(transport, port, "/metrics")[1])
    except HttpStatusError as e:
        if e.status == 401:
            # The server runs with --api-key and we were not given it (or a different one): not a dead server.
            detail = "/v1/models answered 401: the server requires its API key (the host's vllm_api_key)"
            return replace(report, state=HealthState.MISCONFIGURED, detail=detail)
        return replace(report, state=HealthState.DEAD, detail=f"/health is 200 but {e}")
    data = models.get("data") or []
    ids = tuple(str(m.get("id")) for m in data)
    served = next((m for m in data if m.get("id") == expected.served_model_name), None)
    report = replace(
        report,
        version=version,
        served_models=ids,
        max_model_len=(served or (data[0] if data else {})).get("max_model_len"),
        **_metric_fields(metrics),
    )
    problems = []
    if served is None:
        problems.append(f"serves {', '.join(ids) or 'nothing'}, expected {expected.served_model_name}")
    if expected.max_model_len is not None and report.max_model_len != expected.max_model_len:
        problems.append(f"max_model_len {report.max_model_len}, expected {expected.max_model_len}")
    for key, want in expected.cache_config.items():
        got = metrics.cache_config.get(key)
        if got != want:
            problems.append(f"{key}={got}, expected {want}")
    if problems:
        return replace(report, state=HealthState.MISCONFIGURED, detail="; ".join(problems))
    return replace(report, state=HealthState.READY, detail=f"/health 200, serving {expected.served_model_name} (vLLM {version})")


def _metric_fields(m: Metrics) -> dict[str, Any]:
    def as_int(v: float | None) -> int | None:
        return None if v is None else int(v)

    return {
        "kv_cache_usage": m.get(KV_USAGE),
        "running": as_int(m.get(RUNNING)),
        "waiting": as_int(m.get(WAITING)),
        "prefix_cache_hit_rate": m.prefix_cache_hit_rate,
        "cache_config": m.cache_config,
    }


def wait_until_ready(
    transport: Transport,
    expected: Expected,
    timeout_s: float,
    poll_s: float = 2.0,
    grace_s: float = DEFAULT_GRACE_S,
    api_key: str | None = None,
) -> HealthReport:
    """Poll check() until ready. Returns early on dead or misconfigured (waiting cannot fix those).

    When the result is not ready, the report carries the container's last 30 log lines.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        report = check(transport, expected, grace_s=grace_s, api_key=api_key)
        if report.state in (HealthState.READY, HealthState.DEAD, HealthState.MISCONFIGURED):
            break
        if time.monotonic() + poll_s > deadline:
            report = replace(report, detail=f"{report.detail} (gave up after {timeout_s:.0f} s)")
            break
        time.sleep(poll_s)
    if report.ready or report.state is HealthState.SSH_UNREACHABLE:
        return report
    try:
        logs = tuple(transport.logs(expected.service, tail=30))
    except TransportError:
        logs = ()
    return replace(report, logs=logs)
