"""Where a systemd unit lives, and rendering templates/."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

from gpufleet.quoting import systemd_text


def unit_name(service: str) -> str:
    return f"{service}.service"


def unit_path(service: str) -> str:
    return f"/etc/systemd/system/{unit_name(service)}"


def templates_dir() -> Path:
    # A wheel carries them; an editable checkout reads the repo's.
    packaged = Path(__file__).parent / "templates"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "templates"


@cache
def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates_dir()),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    environment.filters["systemd_text"] = systemd_text
    return environment


def render_template(name: str, **context: object) -> str:
    """templates/<name> rendered; an undefined variable raises."""
    return _environment().get_template(name).render(**context)
