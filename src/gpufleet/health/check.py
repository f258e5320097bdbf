"""Readiness and identity: one state per host, each backed by evidence (docs/health.md).

A TCP connect proves nothing (docker-proxy accepts before vLLM listens), so readiness needs /health 200 and
/v1/models listing the expected id; only then do the identity checks mean anything.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from gpufleet.health.api import DEFAULT_TIMEOUT_S, Answer, NotHttp, fetch
from gpufleet.names import container_label_key
from gpufleet.remote.transport import (
    AnswerTooLarge,
    BadAnswer,
    ContainerInfo,
    DeadlineExceeded,
    Transport,
    TransportError,
    Unreachable,
)
from gpufleet.wire.evidence import DETAIL_CHARS, excerpt
from gpufleet.wire.identity import Expected, identity_problems, reported_max_model_len, served_models
from gpufleet.wire.metrics import KV_USAGE, RUNNING, WAITING, Metrics, parse_metrics

UNREADABLE = "cannot read container state"
# Past this, a running container that does not answer is no longer starting (docs/verify.md).
DEFAULT_GRACE_S = 900.0


class HealthState(StrEnum):
    SSH_UNREACHABLE = "ssh-unreachable"
    CONTAINER_NOT_RUNNING = "container-not-running"
    STARTING = "starting"
    DEAD = "dead"
    MISCONFIGURED = "misconfigured"
    READY = "ready"


@dataclass(frozen=True)
class HealthReport:
    state: HealthState
    detail: str  # one line of evidence
    host: str = ""
    vllm_version: str | None = None
    served_models: tuple[str, ...] = ()
    max_model_len: int | None = None
    kv_cache_usage: float | None = None  # 0..1
    running: int | None = None
    waiting: int | None = None
    prefix_cache_hit_rate: float | None = None  # cumulative
    cache_config: dict[str, str] = field(default_factory=dict, repr=False)
    container: ContainerInfo | None = None
    logs: tuple[str, ...] = ()  # the container's last lines, when a wait fails
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
            "version": self.vllm_version,  # the JSON key stays: docs/cli.md
            "served_model": self.served_model,
            "max_model_len": self.max_model_len,
            "kv_cache_usage": self.kv_cache_usage,
            "running": self.running,
            "waiting": self.waiting,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "container": None
            if c is None
            else {
                "id": c.id,
                "state": c.state,
                "image": c.image,
                "image_id": c.image_id,
                "spec_hash": c.spec_hash,
                "model": c.model,
            },
            "logs": list(self.logs),
        }


# Errors that mean nothing answered HTTP.
_NO_LISTENER_WHY = {
    ConnectionRefusedError: "connection refused",
    http.client.RemoteDisconnected: "the connection closed before any answer",
    ConnectionResetError: "the connection was reset before any answer",
    BrokenPipeError: "the connection closed before the request was sent",
}


def check(
    transport: Transport,
    expected: Expected,
    grace_s: float = DEFAULT_GRACE_S,
    api_key: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> HealthReport:
    """One look at the host: container state, then HTTP, then identity. Never raises.

    timeout_s is the deadline of each HTTP request.
    """
    report = HealthReport(HealthState.STARTING, "", host=transport.name)
    try:
        report = _check(transport, expected, report, grace_s, api_key, timeout_s)
        report = _drift(report, expected)
    except Exception as e:  # a state for anything, even a case nobody foresaw
        report = replace(report, state=HealthState.DEAD, detail=f"the check failed: {type(e).__name__}: {e}")
    return replace(report, detail=excerpt(report.detail, DETAIL_CHARS))


def spec_drift(expected: Expected, container: ContainerInfo | None) -> str | None:
    """One line when the running container was started from another spec than the expected one, else None."""
    if expected.spec_hash is None or container is None or not container.running:
        return None
    if container.spec_hash == expected.spec_hash:
        return None
    return (
        f"drift: container {container.id} runs spec {container.spec_hash or 'unlabelled'}, the inventory's "
        f"spec is {expected.spec_hash} (fix: converge the host)"
    )


def committed_drift(committed_ref: str | None, container: ContainerInfo | None) -> str | None:
    """One line when the running container is not on the ledger's committed digest, else None."""
    if committed_ref is None or container is None or not container.running or container.image == committed_ref:
        return None
    return f"runs {container.image or 'an unnamed image'}, not {committed_ref}, which its ledger has committed"


def _drift(report: HealthReport, expected: Expected) -> HealthReport:
    # A server that looks right but runs another spec is not ready.
    drift = spec_drift(expected, report.container)
    if drift is None:
        return report
    state = HealthState.MISCONFIGURED if report.ready else report.state
    return replace(report, state=state, detail=f"{drift}; {report.detail}" if report.detail else drift)


def _check(
    transport: Transport,
    expected: Expected,
    report: HealthReport,
    grace_s: float,
    api_key: str | None,
    timeout_s: float,
) -> HealthReport:
    try:
        container = transport.container(expected.service)
    except Unreachable as e:
        return replace(report, state=HealthState.SSH_UNREACHABLE, detail=str(e))
    except TransportError as e:
        return replace(report, state=HealthState.CONTAINER_NOT_RUNNING, detail=f"{UNREADABLE}: {e}")
    report = replace(report, container=container)
    if container is None:
        return replace(
            report,
            state=HealthState.CONTAINER_NOT_RUNNING,
            detail=f"no container labelled {container_label_key(expected.service)}",
        )
    if container.state in ("exited", "dead", "restarting"):
        code = "" if container.exit_code is None else f" (exit code {container.exit_code})"
        return replace(report, state=HealthState.DEAD, detail=f"container {container.id} is {container.state}{code}")
    if not container.running:
        return replace(
            report, state=HealthState.CONTAINER_NOT_RUNNING, detail=f"container {container.id} is {container.state}"
        )
    try:
        return _check_http(transport, reached(expected, container), report, api_key, timeout_s)
    except TransportError as e:
        return replace(report, state=HealthState.SSH_UNREACHABLE, detail=str(e))
    except (NotHttp, AnswerTooLarge) as e:  # something answers, and it is not vLLM's API
        return replace(report, state=HealthState.MISCONFIGURED, detail=str(e))
    except BadAnswer as e:
        return replace(report, state=HealthState.DEAD, detail=str(e))
    except OSError as e:  # no complete answer
        return _not_answering(report, expected.port, container, grace_s, e)


def reached(expected: Expected, container: ContainerInfo | None) -> Expected:
    """Where the checks go: the running container's own address, so that what answers is that container, else
    the published port."""
    if container is None or not container.running or not container.address:
        return expected
    return replace(expected, address=container.address)


def _not_answering(
    report: HealthReport, port: int, container: ContainerInfo, grace_s: float, e: OSError
) -> HealthReport:
    """Still starting, unless it has been up longer than the grace."""
    if isinstance(e, DeadlineExceeded):
        why, how = str(e), "in time"
    else:
        why = next((text for kind, text in _NO_LISTENER_WHY.items() if type(e) is kind), f"{type(e).__name__}: {e}")
        how = "yet"
    up = time.time() - container.started_at if container.started_at else None
    if up is not None and up > grace_s:
        return replace(
            report,
            state=HealthState.DEAD,
            detail=f"port {port} still not answering {up:.0f} s after start (grace {grace_s:.0f} s): {why}",
        )
    since = f" (up {up:.0f} s)" if up is not None else ""
    return replace(
        report,
        state=HealthState.STARTING,
        detail=f"container running{since}, port {port} not answering {how}: {why}",
    )


def _status_state(status: int) -> HealthState:
    # vLLM answers 5xx when its engine is gone; any other status is not vLLM's.
    return HealthState.DEAD if 500 <= status < 600 else HealthState.MISCONFIGURED


def _quoted(answer: Answer) -> str:
    """'404: Not Found': the status and the start of the body."""
    return f"{answer.status}: {excerpt(answer.body)}" if answer.body else str(answer.status)


def _check_http(
    transport: Transport, expected: Expected, report: HealthReport, api_key: str | None, timeout_s: float
) -> HealthReport:
    def fetch_(path: str, key: str | None = None) -> Answer:
        return fetch(transport, expected.port, path, timeout=timeout_s, api_key=key, address=expected.address)

    health = fetch_("/health")
    if health.status != 200:
        return replace(report, state=_status_state(health.status), detail=f"/health answered {_quoted(health)}")
    listing = fetch_("/v1/models", api_key)
    if listing.status == 401:
        detail = "/v1/models answered 401: the server requires its API key (the host's vllm_api_key)"
        return replace(report, state=HealthState.MISCONFIGURED, detail=detail)
    if listing.status != 200:
        detail = f"/health is 200 but /v1/models answered {_quoted(listing)}"
        return replace(report, state=_status_state(listing.status), detail=detail)
    try:
        models = served_models(listing.body)
    except ValueError as e:
        return replace(report, state=HealthState.MISCONFIGURED, detail=f"/v1/models {e}")
    vllm_version = _vllm_version(fetch_("/version"))
    scrape = fetch_("/metrics")
    if scrape.status != 200:
        return replace(report, state=_status_state(scrape.status), detail=f"/metrics answered {_quoted(scrape)}")
    try:
        metrics = parse_metrics(scrape.text)
    except ValueError as e:
        return replace(report, state=HealthState.MISCONFIGURED, detail=f"/metrics {e}")
    report = replace(
        report,
        vllm_version=vllm_version,
        served_models=tuple(excerpt(model_id, 200) for model_id, _ in models),
        max_model_len=reported_max_model_len(expected, models),
        **_metric_fields(metrics),
    )
    problems = identity_problems(expected, models, metrics.cache_config)
    if problems:
        return replace(report, state=HealthState.MISCONFIGURED, detail="; ".join(problems))
    return replace(
        report,
        state=HealthState.READY,
        detail=f"/health 200, serving {expected.served_model_name} (vLLM {vllm_version})",
    )


def _vllm_version(answer: Answer) -> str | None:
    """vLLM's release, or None: /version only labels the report."""
    try:
        version = json.loads(answer.body).get("version") if answer.status == 200 else None
    except (ValueError, RecursionError, AttributeError):
        return None
    return excerpt(version, 60) if isinstance(version, str) else None


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
