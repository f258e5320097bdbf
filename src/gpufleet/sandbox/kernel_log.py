"""A test host's own kernel log (they share this machine's kernel): a stand-in dmesg that prints the host's LOG."""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

STANDIN = "/usr/local/bin/dmesg"
LOG = "/etc/gpufleet-standin/kmsg"

SCRIPT = f"""#!/bin/sh
# gpufleet test host: this host's own kernel log (gpufleet.sandbox.kernel_log), not the machine's.
if [ "$(id -u)" != 0 ]; then echo "dmesg: read kernel buffer failed: Operation not permitted" >&2; exit 1; fi
case "$*" in
  "--time-format iso"|"--time-format=iso") [ -f {LOG} ] && cat {LOG}; exit 0;;
esac
echo "dmesg (gpufleet test host): only --time-format iso is modelled" >&2
exit 1
"""


def install(root: Path) -> None:
    standin = root / STANDIN.lstrip("/")
    standin.parent.mkdir(parents=True, exist_ok=True)
    standin.write_text(SCRIPT)
    standin.chmod(0o755)
    clear(root)


def line(at: float, message: str) -> str:
    """A kernel log line as `dmesg --time-format iso` prints it, in UTC (the test hosts' zone)."""
    return f"{datetime.fromtimestamp(at, UTC):%Y-%m-%dT%H:%M:%S,%f+00:00} {message}"


def append(root: Path, lines: Iterable[str]) -> None:
    log = root / LOG.lstrip("/")
    text = log.read_text() if log.exists() else ""
    _replace(log, text + "".join(f"{entry}\n" for entry in lines))


def clear(root: Path) -> None:
    """An empty log, as after a reboot."""
    _replace(root / LOG.lstrip("/"), "")


def _replace(path: Path, text: str) -> None:
    # Renamed into place: a dmesg meanwhile reads a whole log.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
