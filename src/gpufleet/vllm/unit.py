"""The systemd unit wrapping a spec's `docker run` (templates/vllm.service.j2)."""

from __future__ import annotations

import shlex

from gpufleet.quoting import systemd_exec
from gpufleet.units import render_template
from gpufleet.vllm.spec import ServeSpec

DOCKER = "/usr/bin/docker"
STOP_GRACE_S = 60
STOP_MARGIN_S = 30  # between nested timeouts (docs/hardening.md)
START_TIMEOUT_S = 1800
WATCH_EVERY_S = 2
WATCH_GRACE_S = 10


def stop_timeouts(spec: ServeSpec) -> tuple[int, int]:
    """(docker stop --time, TimeoutStopSec)."""
    shutdown = spec.arg("shutdown-timeout")
    vllm_grace = int(shutdown) if isinstance(shutdown, str) and shutdown.isdigit() else 0
    docker_grace = max(STOP_GRACE_S, vllm_grace + STOP_MARGIN_S)
    return docker_grace, docker_grace + STOP_MARGIN_S


def env_file_path(service: str) -> str:
    """Root-only (0600) secrets file, read by systemd, never by `ps` readers."""
    return f"/etc/gpufleet/{service}.env"


def render_unit(spec: ServeSpec, image_ref: str | None = None, model: str | None = None) -> str:
    """model (repo@commit) is in the header, so a new commit is a new unit."""
    image_ref = image_ref or spec.image
    docker_stop_s, timeout_stop_s = stop_timeouts(spec)
    member = spec.group
    return render_template(
        "vllm.service.j2",
        spec=spec,
        image_ref=image_ref,
        model=model,
        env_file=env_file_path(spec.service),
        exec_start=systemd_exec(spec.docker_run_argv(image=image_ref, docker=DOCKER, model=model)),
        docker_stop_s=docker_stop_s,
        timeout_stop_s=timeout_stop_s,
        start_timeout_s=START_TIMEOUT_S,
        member=member,
        watch=systemd_exec(watch_argv(spec)) if member else "",
    )


def watch_argv(spec: ServeSpec) -> list[str]:
    """A group rank's watch: vLLM misses a dead peer while idle (docs/multi-node.md)."""
    member = spec.group
    assert member is not None
    port = member.port
    # ss shows an IPv4 peer of torch's dual-stack socket as [::ffff:a.b.c.d]:port.
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
