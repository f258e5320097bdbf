"""The live per-host view on stderr: a rich Live table on a terminal, else one plain line per change."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text


class Progress:
    def __init__(self, hosts: Sequence[str], console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.phases: dict[str, str] = dict.fromkeys(hosts, "waiting")
        self.since: dict[str, float] = {h: time.monotonic() for h in hosts}
        self.notes: list[str] = []
        self._live: Live | None = None

    def _table(self) -> Table:
        t = Table(show_header=True, box=None)
        t.add_column("host")
        t.add_column("phase")
        t.add_column("for", justify="right")
        now = time.monotonic()
        for host, phase in self.phases.items():
            t.add_row(Text(host), Text(phase), Text(f"{now - self.since[host]:.0f} s"))
        return t

    def phase(self, host: str, text: str) -> None:
        self.phases[host] = text
        self.since[host] = time.monotonic()
        if self._live is not None:
            self._live.update(self._table())
        else:
            # Never wrapped: a wrapped log line reads as several.
            self.console.print(Text(f"{host}: {text}"), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(Text(text), highlight=False)
        else:
            self.console.print(Text(text), highlight=False, soft_wrap=True)

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.__exit__(None, None, None)
            self._live = None
