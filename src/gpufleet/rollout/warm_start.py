"""How a swapped host's container started, from its own `docker logs -t`: whether the engine loaded compiled
artifacts (warm) or compiled them (cold), and its time to ready (container start to its first "listening" line)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime

# The engine's own lines (vLLM 0.32) on loading its torch.compile artifacts from the cache, and on compiling: the AOT
# path (torch >= 2.10, the default), then the piecewise backend's own cache (VLLM_USE_AOT_COMPILE=0).
LOADED = ("Directly load AOT compilation from path", "Directly load the compiled graph(s)")
RECOMPILED = ("saved AOT compiled function to", "Compiling model again due to a load failure",
              "Compiling a graph for compile range")
# The first line once the server listens (uvicorn's; vLLM's API server, and the stand-in, print it).
LISTENING = ("Uvicorn running on", "Application startup complete", "Starting vLLM server on")


def start_report(lines: Sequence[str], started_at: float | None) -> tuple[bool | None, float | None]:
    """From `docker logs -t` of the running container: (loaded compiled artifacts, container start to listening)."""
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
    """docker logs -t's RFC 3339 stamp (nanoseconds, Z) -> epoch seconds."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", stamp)
    if not m:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(m.group(1) + zone).timestamp() + float(m.group(2) or 0)
