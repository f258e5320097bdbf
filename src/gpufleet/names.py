"""The names gpufleet gives things on a host, whichever the service."""

from __future__ import annotations

import re

# Unit and file names are made of it.
SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LOOPBACK = "127.0.0.1"


def url_host(address: str) -> str:
    """An IP address as a URL's host part: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


def container_label_key(service: str) -> str:
    """The label the service's container is found by; its value is the spec hash."""
    return f"gpufleet.{service}"
