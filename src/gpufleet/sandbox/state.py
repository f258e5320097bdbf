"""The fleet's state file: every process, mount, netns and link it created, so a later run clears exactly those."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from gpufleet.sandbox import procs


class State:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # hosts boot from threads
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def add(self, kind: str, item: object) -> None:
        with self._lock:
            items = self.data.setdefault(kind, [])
            if item not in items:
                items.append(item)
            self._save()

    def discard(self, kind: str, item: object) -> None:
        with self._lock:
            if item in self.data.get(kind, []):
                self.data[kind].remove(item)
            self._save()

    def items(self, kind: str) -> list[Any]:
        return list(self.data.get(kind, []))

    def add_pid(self, name: str, pid: int) -> None:
        """Record a PID with its kernel start time."""
        with self._lock:
            self.data.setdefault("pids", {})[name] = [pid, procs.start_time(pid)]
            self._save()

    def pid(self, name: str) -> tuple[int, str | None] | None:
        entry = self.data.get("pids", {}).get(name)
        return (entry[0], entry[1]) if entry else None

    def live_pid(self, name: str) -> int | None:
        entry = self.pid(name)
        if entry and procs.alive(entry[0]) and procs.start_time(entry[0]) == entry[1]:
            return entry[0]
        return None

    def drop_pid(self, name: str) -> None:
        with self._lock:
            self.data.get("pids", {}).pop(name, None)
            self._save()

    def set(self, key: str, value: object) -> None:
        with self._lock:
            self.data[key] = value
            self._save()

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)
