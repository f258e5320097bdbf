"""What a command is doing while it works, one row per host on stderr: a live table, or piped a line per change."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text


class FleetProgress:
    def __init__(self, console: Console):
        self.console = console
        self.phases: dict[str, tuple[str, float]] = {}
        self._live: Live | None = None

    def _table(self) -> Table:
        t = Table(show_header=True, box=None)
        for column in ("host", "doing", "for"):
            t.add_column(column, justify="right" if column == "for" else "left")
        now = time.monotonic()
        for host, (phase, since) in self.phases.items():
            t.add_row(Text(host), Text(phase), Text(f"{now - since:.0f} s"))
        return t

    def phase(self, host: str, text: str) -> None:
        self.phases[host] = (text, time.monotonic())
        if self._live is not None:
            self._live.update(self._table())
        else:
            self.console.print(Text(f"{host}: {text}"), highlight=False, soft_wrap=True)

    def note(self, text: str) -> None:
        self.console.print(Text(text), highlight=False, soft_wrap=True)

    def __enter__(self) -> FleetProgress:
        if self.console.is_terminal and not self.console.quiet:
            self._live = Live(self._table(), console=self.console, refresh_per_second=2, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
