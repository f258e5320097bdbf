"""The systemd unit that wraps a spec's exact `docker run`, rendered from templates/vllm.service.j2."""

from __future__ import annotations

from gpufleet.quoting import systemd_exec
from gpufleet.units import render_template
from gpufleet.vllm.spec import ServeSpec

DOCKER = "/usr/bin/docker"
# `docker stop --time`: how long docker waits for the container before SIGKILL. At least this, and always
# STOP_MARGIN_S more than vLLM's own graceful shutdown (--shutdown-timeout), so docker never cuts it short.
STOP_GRACE_S = 60
# systemd's TimeoutStopSec sits this much above docker's grace: systemd must not kill `docker stop` itself.
STOP_MARGIN_S = 30
START_TIMEOUT_S = 1800


def stop_timeouts(spec: ServeSpec) -> tuple[int, int]:
    """(docker stop --time, TimeoutStopSec) for spec: both above vLLM's --shutdown-timeout, if it sets one;
    --shutdown-timeout 120 gives (150, 180), none gives (60, 90)."""
    shutdown = spec.arg("shutdown-timeout")
    vllm_grace = int(shutdown) if isinstance(shutdown, str) and shutdown.isdigit() else 0
    docker_grace = max(STOP_GRACE_S, vllm_grace + STOP_MARGIN_S)
    return docker_grace, docker_grace + STOP_MARGIN_S


def env_file_path(service: str) -> str:
    """Root-only (0600) file with the service's secrets, read by systemd, never by `ps` readers."""
    return f"/etc/gpufleet/{service}.env"


def render_unit(spec: ServeSpec, image_ref: str | None = None, model: str | None = None) -> str:
    """The unit text for spec, running image_ref (the pinned digest at deploy time; the spec's image if None);
    model: the model's commit (repo@commit), named in the header so that a new commit is a new unit."""
    image_ref = image_ref or spec.image
    docker_stop_s, timeout_stop_s = stop_timeouts(spec)
    return render_template(
        "vllm.service.j2", spec=spec, image_ref=image_ref, model=model, env_file=env_file_path(spec.service),
        exec_start=systemd_exec(spec.docker_run_argv(image=image_ref, docker=DOCKER, model=model)),
        docker_stop_s=docker_stop_s, timeout_stop_s=timeout_stop_s, start_timeout_s=START_TIMEOUT_S,
    )
