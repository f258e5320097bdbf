"""The names gpufleet gives things on a host, whichever service: the form of a service's name, the loopback address
a host reaches its own services at, an address as a URL's host part, and the label a service's container is found by
(it has no --name). The spec, the transport, the ledger and the health checks all read them here."""

from __future__ import annotations

import re

# A service name: a systemd unit, a container label and file names under /etc and /var/lib are made of it, so it has
# no path separator and starts with a letter or digit (settings refuse others; a ledger naming another is corrupt).
SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LOOPBACK = "127.0.0.1"


def url_host(address: str) -> str:
    """An IP address as the host part of a URL or listen address: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


def container_label_key(service: str) -> str:
    """The label key the unit and the health checks find the service's container by (it has no --name; the
    label's value is the spec hash, for drift detection)."""
    return f"gpufleet.{service}"
