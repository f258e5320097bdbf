"""Carry the compile-cache entries the committed canary wrote to each later host before its swap, so that host
starts warm. The design, its checks and its measurements: docs/compile-cache.md."""

from __future__ import annotations

import contextlib
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import paramiko

from gpufleet.errors import one_line
from gpufleet.facts.nvidia import QUERY_GPUS
from gpufleet.hostlock import LOCK_PATH, HostLock, HostLockError, lock_timings
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import TransportError
from gpufleet.rollout.carry_eligibility import (
    Gpus,
    compile_hash_refusal,
    config_refusal,
    gpu_refusal,
    gpus_from_query,
)
from gpufleet.rollout.carry_entries import (
    CARRIED_MOUNT,
    Listed,
    carried_dir,
    entries,
    files_under,
    listing_command,
    new_files,
    parse_listing,
    placements,
)
from gpufleet.rollout.carry_stream import (
    place_command,
    receive_command,
    relay,
    send_command,
    stream_problem,
    temp_dir,
)
from gpufleet.rollout.compile_factors import TIMEOUT_S as FACTORS_TIMEOUT_S
from gpufleet.rollout.compile_factors import CompileFactors, factors_command, parse_factors
from gpufleet.rollout.hosts import FleetHost, Sessions, shell
from gpufleet.rollout.warm_start import start_report
from gpufleet.vllm.host_command import COMMAND_TIMEOUT_S
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.unit import env_file_path

LIST_TIMEOUT_S = 60.0
CARRY_TIMEOUT_S = 1800.0  # per host: a trickling stream must not hold the host's lock forever


@dataclass(frozen=True)
class CarryResult:
    """One host's part in the carry; None means not known or not measured."""

    carried_bytes: int = 0
    skipped_reason: str | None = None
    entries: tuple[str, ...] = ()  # relative to the cache dir
    warm: bool | None = None
    time_to_ready_s: float | None = None
    canary: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "warm": self.warm,
            "time_to_ready_s": self.time_to_ready_s,
            "carried_bytes": self.carried_bytes,
            "carry_skipped": self.skipped_reason,
        }

    def cell(self) -> str:
        """E.g. "warm, 2.2 s (90 KiB carried)"."""
        start = {True: "warm", False: "cold", None: "-"}[self.warm]
        ready = f", {self.time_to_ready_s:.1f} s" if self.time_to_ready_s is not None else ""
        if self.canary:
            why = "canary"
        elif self.carried_bytes:
            why = f"{self.carried_bytes / 1024:.0f} KiB carried"
        else:
            why = f"not carried: {self.skipped_reason}" if self.skipped_reason else ""
        return f"{start}{ready}" + (f" ({why})" if why else "")


@dataclass
class Carry:
    """The carry across one rollout: before_canary(), after_canary(), then into() and observe() per batch."""

    sessions: Sessions
    hosts: Mapping[str, FleetHost]
    note: Callable[[str], None] = lambda line: None
    tamper: Callable[[bytes], bytes] | None = None  # tests only
    turned_off: str | None = None  # `--no-carry`; starts are still observed for the report
    timeout_s: float = CARRY_TIMEOUT_S
    lock_path: str = LOCK_PATH
    results: dict[str, CarryResult] = field(default_factory=dict)
    canary: str | None = None
    _before: dict[str, Listed] | None = None
    _files: list[str] = field(default_factory=list)
    _entries: list[str] = field(default_factory=list)
    _gpus: Gpus | str = "not read"
    _factors: CompileFactors | str = "not read"
    _image: str | None = None  # the committed canary's image id; every host's factors come from it
    _off: str | None = None

    def _list(self, host: str, directory: str) -> dict[str, Listed]:
        rc, out, err = shell(self.sessions.get(host), listing_command(directory), timeout=LIST_TIMEOUT_S, root=True)
        if rc != 0:
            raise TransportError(one_line(f"cannot list {directory}: {(err or out).strip()[:160] or f'exit {rc}'}"))
        return parse_listing(out)

    def _gpus_of(self, host: str) -> Gpus | str:
        try:
            rc, out, err = shell(
                self.sessions.get(host), f"timeout -k 2 {COMMAND_TIMEOUT_S} {QUERY_GPUS}", timeout=LIST_TIMEOUT_S
            )
        except TransportError as e:
            return one_line(str(e))
        if rc in (124, 137):
            return f"nvidia-smi did not answer within {COMMAND_TIMEOUT_S} s"
        return gpus_from_query(rc, out, err)

    def _started(self, host: str) -> float | None:
        try:
            info = self.sessions.get(host).container(self.hosts[host].spec.service)
        except TransportError:
            return None
        return info.started_at if info is not None and info.running else None

    def _image_of(self, host: str) -> str | None:
        try:
            info = self.sessions.get(host).container(self.hosts[host].spec.service)
        except TransportError:
            return None
        return info.image_id if info is not None else None

    def _factors_of(self, host: str) -> CompileFactors | str:
        if self._image is None:
            return "the canary's image is unknown"
        spec = self.hosts[host].spec
        try:
            rc, out, _ = shell(
                self.sessions.get(host),
                factors_command(spec, self._image, env_file_path(spec.service)),
                timeout=FACTORS_TIMEOUT_S + 15,
                root=True,
            )
        except TransportError as e:
            return one_line(str(e))
        return parse_factors(rc, out)

    def before_canary(self, canary: str) -> None:
        self.canary = canary
        if self.turned_off is not None:
            self._off = self.turned_off
            return
        directory = carried_dir(self.hosts[canary].spec)
        if directory is None:
            self._off = f"canary {canary} mounts no {CARRIED_MOUNT}"
            return
        try:
            self._before = self._list(canary, directory)
        except TransportError as e:
            self._off = f"canary {canary}'s cache dir could not be listed before its swap: {e}"

    def after_canary(self, committed: bool) -> None:
        canary = self.canary
        if canary is None:
            return
        if not committed:
            self._off = f"canary {canary} was not committed on the new version: nothing is carried"
            return
        if self._off is not None or self._before is None:
            self.results[canary] = CarryResult(skipped_reason=self._off, canary=True)
            return
        directory = carried_dir(self.hosts[canary].spec)
        assert directory is not None
        try:
            after = self._list(canary, directory)
        except TransportError as e:
            self._off = f"canary {canary}'s cache dir could not be listed after its verify: {e}"
            return
        since = self._started(canary)  # files changed before it are the old version's
        if since is None:
            self._off = f"canary {canary}'s new container could not be read: nothing is carried"
            return
        self._files = new_files(self._before, after, since)
        self._entries = entries(self._before, self._files)
        self._gpus = self._gpus_of(canary)
        if not self._files:
            self._off = f"canary {canary} wrote no new entry in {directory}"
        else:
            self._image = self._image_of(canary)
            self._factors = self._factors_of(canary)
        self.results[canary] = CarryResult(entries=tuple(self._files), canary=True, skipped_reason=self._off)
        self.note(
            self._off
            or f"carrying {len(self._files)} new compile-cache file(s) from canary {canary} "
            f"({directory}) to each later host before its swap"
        )

    def into(self, batch: Sequence[str]) -> None:
        for host in batch:
            if host == self.canary:
                continue
            self.results[host] = result = self._into(host)
            if result.skipped_reason:
                self.note(f"{host}: compile cache not carried: {result.skipped_reason}")

    def _into(self, host: str) -> CarryResult:
        if self.canary is None or self._off is not None:
            return CarryResult(skipped_reason=self._off or "no canary")
        directory = carried_dir(self.hosts[host].spec)
        source = carried_dir(self.hosts[self.canary].spec)
        if directory is None or source is None:
            return CarryResult(skipped_reason=f"it mounts no {CARRIED_MOUNT}")
        refusal = (
            config_refusal(self.canary, self.hosts[self.canary].spec, self.hosts[host].spec)
            or gpu_refusal(self.canary, self._gpus, self._gpus_of(host))
            or compile_hash_refusal(self.canary, self._factors, self._factors_of(host))
        )
        if refusal is not None:
            return CarryResult(skipped_reason=refusal)
        deadline = time.monotonic() + self.timeout_s
        try:
            lock = self._lock(host)
        except (HostLockError, TransportError, OSError, paramiko.SSHException, EOFError) as e:
            return CarryResult(skipped_reason=one_line(f"its lock: {e}"))
        with lock:
            return self._under_lock(host, directory, source, deadline)

    def _lock(self, host: str) -> HostLock:
        wait_s, lease_s = lock_timings(host, merged_settings(dict(getattr(self.hosts[host], "data", {}))))
        client = self.sessions.get(host).client
        return HostLock(client, host, path=self.lock_path, lease_s=lease_s, sudo=needs_sudo(client)).acquire(wait_s)

    def _under_lock(self, host: str, directory: str, source: str, deadline: float) -> CarryResult:
        assert self.canary is not None
        tmp = temp_dir(directory)
        try:
            present = self._list(host, directory)
            roots, partial = placements(self._entries, self._files, present)
            kept = f"it has part of {', '.join(partial)} already (an earlier start's): left as it is"
            if not roots:
                return CarryResult(skipped_reason=kept if partial else "it has every entry already")
            if partial:
                self.note(f"{host}: {kept}")
            files = files_under(self._files, roots)
            total, relayed, sent, received = relay(
                self.sessions.get(self.canary),
                send_command(source),
                "\0".join(files).encode() + b"\0",
                self.sessions.get(host),
                receive_command(directory, tmp),
                self.tamper,
                deadline,
            )
            problem = stream_problem(sent, relayed, received)
            if problem is not None:
                self._remove(host, tmp)
                return CarryResult(skipped_reason=f"refused: {problem}")
            rc, out, err = shell(
                self.sessions.get(host), place_command(directory, tmp, roots), timeout=LIST_TIMEOUT_S, root=True
            )
        except (TransportError, OSError, paramiko.SSHException, EOFError) as e:
            self._remove(host, tmp)
            return CarryResult(skipped_reason=one_line(f"carry failed: {e}"))
        placed = tuple(line.removeprefix("placed ") for line in out.splitlines() if line.startswith("placed "))
        refused = [line.removeprefix("refused ") for line in out.splitlines() if line.startswith("refused ")]
        if rc != 0:
            return CarryResult(
                entries=placed,
                skipped_reason=one_line(
                    f"putting the entries in place failed: {(err or out).strip()[:160] or f'exit {rc}'}"
                ),
            )
        if not placed:
            return CarryResult(
                skipped_reason=one_line(f"not placed: {'; '.join(refused)}")
                if refused
                else "it has every entry already"
            )
        for line in refused:
            self.note(one_line(f"{host}: not placed: {line}"))
        return CarryResult(carried_bytes=total, entries=placed)

    def _remove(self, host: str, tmp: str) -> None:
        """Best effort: an unreachable host keeps a hidden temp dir, never a cache entry."""
        with contextlib.suppress(TransportError, OSError, paramiko.SSHException, EOFError):
            shell(self.sessions.get(host), f"rm -rf {shlex.quote(tmp)}", timeout=LIST_TIMEOUT_S, root=True)

    def observe(self, batch: Sequence[str]) -> None:
        """Record each swapped host's start: warm or cold, and its time to ready."""
        for host in batch:
            warm, took = self.start_of(host)
            prior = self.results.get(host, CarryResult(canary=host == self.canary))
            self.results[host] = CarryResult(
                prior.carried_bytes, prior.skipped_reason, prior.entries, warm, took, prior.canary
            )

    def start_of(self, host: str) -> tuple[bool | None, float | None]:
        try:
            transport = self.sessions.get(host)
            info = transport.container(self.hosts[host].spec.service)
            if info is None:
                return None, None
            sudo = "sudo -n " if needs_sudo(transport.client) else ""
            rc, out, _ = transport.shell(
                f"{sudo}docker logs -t {shlex.quote(info.id)} 2>&1 | head -n 2000", timeout=LIST_TIMEOUT_S
            )
        except TransportError:
            return None, None
        return start_report(out.splitlines(), info.started_at) if rc == 0 else (None, None)
