"""The names gpufleet gives things on a host."""

from __future__ import annotations

import re

SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # unit and file names
LOOPBACK = "127.0.0.1"


def url_host(address: str) -> str:
    """IPv6 in brackets, for a URL."""
    return f"[{address}]" if ":" in address else address


def container_label_key(service: str) -> str:
    """The container's label; its value is the spec hash."""
    return f"gpufleet.{service}"
