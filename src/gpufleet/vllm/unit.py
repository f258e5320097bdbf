"""The systemd unit that wraps a spec's exact `docker run`, rendered from templates/vllm.service.j2."""

from __future__ import annotations

import shlex

from gpufleet.quoting import systemd_exec
from gpufleet.units import render_template
from gpufleet.vllm.spec import ServeSpec

DOCKER = "/usr/bin/docker"
STOP_GRACE_S = 60  # docker stop --time, at least
# Each timeout sits this much above the one inside it, so none cuts a graceful shutdown short.
STOP_MARGIN_S = 30
START_TIMEOUT_S = 1800
# A replica group's watch: how often it looks at its peers' connections, and how long one may be gone.
WATCH_EVERY_S = 2
WATCH_GRACE_S = 10


def stop_timeouts(spec: ServeSpec) -> tuple[int, int]:
    """(docker stop --time, TimeoutStopSec), both above vLLM's --shutdown-timeout."""
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
    member = spec.group
    return render_template(
        "vllm.service.j2", spec=spec, image_ref=image_ref, model=model, env_file=env_file_path(spec.service),
        exec_start=systemd_exec(spec.docker_run_argv(image=image_ref, docker=DOCKER, model=model)),
        docker_stop_s=docker_stop_s, timeout_stop_s=timeout_stop_s, start_timeout_s=START_TIMEOUT_S,
        member=member, watch=systemd_exec(watch_argv(spec)) if member else "",
    )


def watch_argv(spec: ServeSpec) -> list[str]:
    """A group rank's watch (the unit's ExecStartPost, in its cgroup): once every peer held its connection to the
    head's master port, a peer gone for WATCH_GRACE_S kills this rank's container, and systemd restarts it to wait
    for its group again. vLLM notices neither a rank nor a head that died while no request runs (docs/multi-node.md).
    """
    member = spec.group
    assert member is not None
    port = member.port
    # ss shows an IPv4 peer of a dual-stack socket (torch's store listens on one) as [::ffff:a.b.c.d]:port.
    script = (
        f"p={shlex.quote(' '.join(member.peers))}; seen=; gone=0; while sleep {WATCH_EVERY_S}; do "
        f"c=$(ss -Htn state established '( sport = :{port} or dport = :{port} )' 2>/dev/null); m=; "
        'for a in $p; do case "$c" in *" $a:"*|*"[$a]:"*|*"[::ffff:$a]:"*) ;; *) m=$a;; esac; done; '
        'if [ -z "$m" ]; then seen=1; gone=0; elif [ -n "$seen" ]; then '
        f"gone=$((gone + {WATCH_EVERY_S})); if [ $gone -ge {WATCH_GRACE_S} ]; then "
        f'echo "gpufleet group watch: $m left group {member.group}: stopping this rank"; '
        f"docker ps -q --filter label={spec.container_label_key} | xargs -r docker kill; exit 0; fi; fi; done &"
    )
    return ["/bin/sh", "-c", script]
