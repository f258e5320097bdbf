#!/usr/bin/env python3
"""`pyinfra ARGS...` with every shell command it sends over SSH recorded (for bench/noop_breakdown.py).

    BENCH_TRACE=trace.json python bench/pyinfra_traced.py -y INVENTORY deploys/qwen35.py

trace.json: [{"host", "command" (the exact string sent, sudo wrapper included), "seconds" (sent to exit status,
as the controller sees it)}] in the order the commands finished.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

from pyinfra.connectors import ssh
from pyinfra_cli.main import main

TRACE: list[dict] = []
_make_command = ssh.make_unix_command_for_host
_run = ssh.SSHConnector.run_shell_command


def _recording_make_command(state, host, command, **arguments):
    unix_command = _make_command(state, host, command, **arguments)
    TRACE.append({"host": host.name, "command": unix_command.get_raw_value(), "seconds": None})
    return unix_command


def _timed_run(self, command, *args, **kwargs):
    t0 = time.monotonic()
    try:
        return _run(self, command, *args, **kwargs)
    finally:
        # the last command made for this host is the one that just ran (a host runs one command at a time)
        mine = [t for t in TRACE if t["host"] == self.host.name and t["seconds"] is None]
        if mine:
            mine[-1]["seconds"] = time.monotonic() - t0


ssh.make_unix_command_for_host = _recording_make_command
ssh.SSHConnector.run_shell_command = _timed_run
atexit.register(lambda: Path(os.environ["BENCH_TRACE"]).write_text(json.dumps(TRACE)))

if __name__ == "__main__":
    sys.argv[0] = "pyinfra"
    sys.exit(main())
