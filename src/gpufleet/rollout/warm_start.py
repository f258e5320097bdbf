"""Whether a swapped host's container started warm, and its time to ready, from its `docker logs -t`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

# vLLM 0.32's lines: the AOT path first, then the piecewise backend's (VLLM_USE_AOT_COMPILE=0).
LOADED = ("Directly load AOT compilation from path", "Directly load the compiled graph(s)")
RECOMPILED = (
    "saved AOT compiled function to",
    "Compiling model again due to a load failure",
    "Compiling a graph for compile range",
)
LISTENING = ("Uvicorn running on", "Application startup complete", "Starting vLLM server on")


def start_report(lines: Sequence[str], started_at: float | None) -> tuple[bool | None, float | None]:
    """(loaded compiled artifacts, container start to listening)."""
    warm: bool | None = None
    ready: float | None = None
    for line in lines:
        if any(mark in line for mark in LOADED):
            warm = True
        elif any(mark in line for mark in RECOMPILED):
            warm = False
        if ready is None and any(mark in line for mark in LISTENING):
            ready = _docker_time(line.split(" ", 1)[0])
    took = ready - started_at if ready is not None and started_at is not None else None
    return warm, (round(took, 2) if took is not None and took >= 0 else None)


def _docker_time(stamp: str) -> float | None:
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    if not m:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(m.group(2) or 0)
