"""The systemd unit that wraps a spec's exact `docker run`, rendered from templates/vllm.service.j2."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

from gpufleet.quoting import systemd_exec
from gpufleet.spec import ServeSpec

DOCKER = "/usr/bin/docker"
STOP_GRACE_S = 60
START_TIMEOUT_S = 1800


def unit_name(spec: ServeSpec) -> str:
    return f"{spec.service}.service"


def unit_path(spec: ServeSpec) -> str:
    return f"/etc/systemd/system/{unit_name(spec)}"


def env_file_path(spec: ServeSpec) -> str:
    """Root-only (0600) file with the service's secrets, read by systemd, never by `ps` readers."""
    return f"/etc/gpufleet/{spec.service}.env"


def templates_dir() -> Path:
    # Installed wheels carry the templates inside the package; an editable checkout reads the repo's templates/.
    packaged = Path(__file__).parent / "templates"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "templates"


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, autoescape=False,
    )


def render_unit(spec: ServeSpec, image_ref: str | None = None) -> str:
    """The unit text for spec, running image_ref (the pinned digest at deploy time; the spec's image if None)."""
    image_ref = image_ref or spec.image
    return _environment().get_template("vllm.service.j2").render(
        spec=spec, image_ref=image_ref, env_file=env_file_path(spec),
        exec_start=systemd_exec(spec.docker_run_argv(image=image_ref, docker=DOCKER)),
        stop_grace_s=STOP_GRACE_S, start_timeout_s=START_TIMEOUT_S,
    )
