"""systemd units gpufleet writes, whichever service they run: where a unit lives, and the templates/ they are
rendered from (jinja2, undefined names are errors; free text through the systemd_text filter)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

from gpufleet.quoting import systemd_text


def unit_name(service: str) -> str:
    """The systemd unit of a service: "vllm-qwen35" -> "vllm-qwen35.service"."""
    return f"{service}.service"


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{unit_name(service)}"


def templates_dir() -> Path:
    # Installed wheels carry the templates inside the package; an editable checkout reads the repo's templates/.
    packaged = Path(__file__).parent / "templates"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "templates"


@cache
def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, autoescape=False,
    )
    # Free text in the unit (Description=, the header comment) goes through this filter: see systemd_text.
    environment.filters["systemd_text"] = systemd_text
    return environment


def render_template(name: str, **context: object) -> str:
    """templates/<name> rendered with context (undefined names are errors)."""
    return _environment().get_template(name).render(**context)
