"""Only the canary compiles: once the canary is committed on the new version, the compile-cache entries that version
wrote on it are carried to each later host's cache dir before that host's swap, so it starts warm
(docs/compile-cache.md).

- What is carried: the files new in the canary's vLLM cache dir (the host side of the /root/.cache/vllm mount:
  vLLM 0.32 keeps its torch.compile artifacts, inductor's C++/Triton kernels included, under
  torch_compile_cache/torch_aot_compile/<hash of its version and config>/) between a listing taken before its swap
  and one taken after it committed. Files that were there before, and the other mounts (torch, ComputeCache), are
  not carried.
- How: over the rollout's own SSH sessions; the controller streams `tar` from the canary to the host (hosts need no
  SSH to each other). The canary hashes what it sends, the controller what it relays, the host what it receives
  (sha256 each); the host unpacks into a temp dir beside its cache dir, and only when all three agree are the
  entries renamed into place. An entry the host already has is never overwritten: the host still runs the old
  version, which writes its own version's entries there, never the new one's.
- Who does not take it: a host whose GPUs (model, count) or driver differ from the canary's, or whose serve flags
  (other than where it listens and its served name) or env differ; one whose listing or GPU query fails (one line
  each, the rollout goes on: that host just starts cold); a rollout whose canary is not committed carries nothing.

Per host, CarryResult says what was carried (or why not), whether its start loaded compiled artifacts (the
engine's own log line) and its time to ready (container start to its first "listening" log line, both from docker
on the host)."""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import paramiko

from gpufleet.errors import one_line
from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import SshTransport, TransportError
from gpufleet.rollout.fleet import FleetHost, Sessions, run
from gpufleet.spec import ServeSpec

CARRIED_MOUNT = "/root/.cache/vllm"  # the container side of the one mount whose new entries are carried
GPU_QUERY = "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"
# The engine's own lines (vLLM 0.32) on loading its torch.compile artifacts from the cache, and on compiling: the AOT
# path (torch >= 2.10, the default), then the piecewise backend's own cache (VLLM_USE_AOT_COMPILE=0).
LOADED = ("Directly load AOT compilation from path", "Directly load the compiled graph(s)")
RECOMPILED = ("saved AOT compiled function to", "Compiling model again due to a load failure",
              "Compiling a graph for compile range")
# The first line once the server listens (uvicorn's; vLLM's API server, and the stand-in, print it).
LISTENING = ("Uvicorn running on", "Application startup complete", "Starting vLLM server on")
STREAM_CHUNK = 256 * 1024
STREAM_TIMEOUT_S = 120.0  # per read or write on a channel: a host that stops answering ends the carry to it
LIST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CarryResult:
    """One host's part in the carry. carried_bytes: the tar stream relayed and put in place (0: nothing carried);
    skipped_reason: one line, why nothing was carried (None when it was, or when the canary gave it); warm: its
    start loaded compiled artifacts (the engine's log says so; None: not known); time_to_ready_s: its container's
    start to its first listening line (None: not measured)."""

    carried_bytes: int = 0
    skipped_reason: str | None = None
    entries: tuple[str, ...] = ()  # cache-dir-relative paths renamed into place
    warm: bool | None = None
    time_to_ready_s: float | None = None
    canary: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The fields a rollout's JSON row takes."""
        return {"warm": self.warm, "time_to_ready_s": self.time_to_ready_s, "carried_bytes": self.carried_bytes,
                "carry_skipped": self.skipped_reason}

    def cell(self) -> str:
        """One table cell: how the host started and why, e.g. "warm, 2.2 s (90 KiB carried)"."""
        start = {True: "warm", False: "cold", None: "-"}[self.warm]
        ready = f", {self.time_to_ready_s:.1f} s" if self.time_to_ready_s is not None else ""
        if self.canary:
            why = "canary"
        elif self.carried_bytes:
            why = f"{self.carried_bytes / 1024:.0f} KiB carried"
        else:
            why = f"not carried: {self.skipped_reason}" if self.skipped_reason else ""
        return f"{start}{ready}" + (f" ({why})" if why else "")


@dataclass(frozen=True)
class Gpus:
    names: tuple[str, ...]  # one per GPU, in nvidia-smi's order
    driver: str

    def describe(self) -> str:
        if not self.names:
            return "no GPU"
        kinds = sorted(set(self.names))
        return f"{len(self.names)}x {'/'.join(kinds)}, driver {self.driver}"


# --- pure decisions ----------------------------------------------------------------------------------------------
def carried_dir(spec: ServeSpec) -> str | None:
    """The host side of the spec's vLLM cache mount (None: the spec mounts none, so there is nothing to carry)."""
    for m in spec.mounts:
        if posixpath.normpath(m.container_path) == CARRIED_MOUNT:
            return posixpath.normpath(m.host_path)
    return None


def listing_command(directory: str) -> str:
    """Every path under directory, NUL-terminated, each prefixed with find's type letter (f, d, l, ...); nothing
    when the directory does not exist."""
    d = shlex.quote(directory)
    return f"if [ -d {d} ]; then cd {d} && find . -mindepth 1 -printf '%y %P\\0'; fi"


def parse_listing(out: str) -> dict[str, str]:
    """find's answer -> {relative path: type letter}."""
    paths = {}
    for item in out.split("\0"):
        if len(item) >= 3 and item[1] == " ":
            paths[item[2:]] = item[0]
    return paths


def new_files(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The files (and links) the canary's new version wrote: present after its verify, absent before its swap."""
    return sorted(p for p, kind in after.items() if kind in "fl" and p not in before)


def placements(files: Iterable[str], present: Mapping[str, str]) -> list[str]:
    """The paths to rename into a host's cache dir so that it has every file: for each file, its shallowest
    ancestor (or itself) the host lacks. A file the host already has is left as it is (never overwritten)."""
    out: set[str] = set()
    for f in files:
        if f in present:
            continue
        parts = f.split("/")
        for i in range(1, len(parts) + 1):
            path = "/".join(parts[:i])
            if path not in present:
                out.add(path)
                break
    # A placement inside another one is moved with it.
    return sorted(p for p in out if not any(p.startswith(q + "/") for q in out))


def files_under(files: Iterable[str], roots: Sequence[str]) -> list[str]:
    return [f for f in files if any(f == r or f.startswith(r + "/") for r in roots)]


def parse_gpus(rc: int, out: str, err: str) -> Gpus | str:
    """nvidia-smi's csv (name, driver per GPU) -> Gpus, or one line saying why not."""
    if rc != 0:
        return one_line(f"nvidia-smi failed: {(err or out).strip()[:160] or f'exit {rc}'}")
    names, drivers = [], set()
    for line in out.strip().splitlines():
        name, sep, driver = line.rpartition(",")
        if not sep:
            return one_line(f"unexpected nvidia-smi output: {line[:120]!r}")
        names.append(name.strip())
        drivers.add(driver.strip())
    if len(drivers) > 1:
        return f"GPUs report different drivers: {', '.join(sorted(drivers))}"
    return Gpus(tuple(names), drivers.pop() if drivers else "")


def gpu_refusal(canary: str, canary_gpus: Gpus | str, host_gpus: Gpus | str) -> str | None:
    """Why a host may not take the canary's compiled artifacts (kernels are built for a GPU and a driver), or None."""
    if isinstance(canary_gpus, str):
        return f"canary {canary}'s GPUs unknown ({canary_gpus})"
    if isinstance(host_gpus, str):
        return f"its GPUs unknown ({host_gpus})"
    if sorted(canary_gpus.names) != sorted(host_gpus.names) or canary_gpus.driver != host_gpus.driver:
        return f"its GPUs ({host_gpus.describe()}) differ from canary {canary}'s ({canary_gpus.describe()})"
    return None


# Flags that do not reach vLLM's compile (where it listens, what it is called): hosts may differ in them.
NOT_COMPILED = frozenset({"host", "port", "served-model-name", "api-key", "uvicorn-log-level"})


def config_refusal(canary: str, canary_spec: ServeSpec, host_spec: ServeSpec) -> str | None:
    """Why a host whose serve flags, env or GPU count differ from the canary's may not take its artifacts (vLLM's
    cache key has missed a config field before and loaded a wrong artifact: carried only between identical
    configs), or None."""
    def flags(spec: ServeSpec) -> dict[str, object]:
        return {k: v for k, v in spec.vllm_args if k not in NOT_COMPILED}

    a, b = flags(canary_spec), flags(host_spec)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    env_a, env_b = dict(canary_spec.env), dict(host_spec.env)
    differ += sorted(f"env {k}" for k in env_a.keys() | env_b.keys() if env_a.get(k) != env_b.get(k))
    if len(canary_spec.gpus) != len(host_spec.gpus):
        differ.append("the number of GPUs it serves on")
    if not differ:
        return None
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return f"its serve config differs from canary {canary}'s ({shown})"


SHA_LINE = re.compile(r"^([0-9a-f]{64})\s+-$", re.MULTILINE)
RC_LINE = re.compile(r"^tar-rc (\d+)$", re.MULTILINE)


def stream_problem(sent: str, relayed: str, received: str) -> str | None:
    """The three ends' view of one tar stream (each `sha256sum` output, `tar-rc N` lines included for the two
    hosts): None when the canary's tar and the host's untar ended well and all three sha256 agree."""
    problems = []
    for who, text in (("canary", sent), ("host", received)):
        rc = RC_LINE.search(text)
        if rc is None or rc.group(1) != "0":
            problems.append(f"tar on the {who} failed ({_last_line(text, 'no exit status')})")
    sha_sent, sha_received = SHA_LINE.search(sent), SHA_LINE.search(received)
    if sha_sent is None or sha_received is None:
        problems.append("a checksum is missing")
    elif not (sha_sent.group(1) == relayed == sha_received.group(1)):
        problems.append(f"checksum mismatch (canary {sha_sent.group(1)[:12]}, relayed {relayed[:12]}, host "
                        f"{sha_received.group(1)[:12]})")
    return "; ".join(problems) or None


def _last_line(text: str, default: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not RC_LINE.match(ln) and not SHA_LINE.match(ln)]
    return lines[-1][:160] if lines else default


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


# --- over SSH ----------------------------------------------------------------------------------------------------
def _root(client: paramiko.SSHClient, command: str) -> str:
    return f"sudo -n sh -c {shlex.quote(command)}" if needs_sudo(client) else f"sh -c {shlex.quote(command)}"


def _open(transport: SshTransport, command: str) -> paramiko.Channel:
    session = transport.client.get_transport()
    if session is None or not session.is_active():
        raise TransportError(f"{transport.name}: SSH session closed")
    channel = session.open_session()
    channel.settimeout(STREAM_TIMEOUT_S)
    channel.exec_command(_root(transport.client, command))
    return channel


def _drain_stderr(channel: paramiko.Channel, into: list[bytes]) -> None:
    while channel.recv_stderr_ready():
        into.append(channel.recv_stderr(65536))


def relay(source: SshTransport, source_cmd: str, source_input: bytes, target: SshTransport, target_cmd: str,
          tamper: Callable[[bytes], bytes] | None = None) -> tuple[int, str, str, str]:
    """source_cmd's stdout streamed into target_cmd's stdin through this process: (bytes relayed, its sha256,
    source's stderr, target's stderr). tamper: for tests, what the bytes become between the two ends."""
    src = _open(source, source_cmd)
    dst = _open(target, target_cmd)
    src_err: list[bytes] = []
    dst_err: list[bytes] = []
    digest = hashlib.sha256()
    total = 0
    def feed() -> None:  # beside the reading below: tar writes while it still reads its list
        try:
            src.sendall(source_input)
            src.shutdown_write()
        except OSError:
            pass  # the source ended early: its exit status and stderr say why

    writer = threading.Thread(target=feed, daemon=True)
    try:
        writer.start()
        while True:
            chunk = src.recv(STREAM_CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            total += len(chunk)
            dst.sendall(tamper(chunk) if tamper else chunk)
            _drain_stderr(src, src_err)
            _drain_stderr(dst, dst_err)
        dst.shutdown_write()
        writer.join(STREAM_TIMEOUT_S)
        for channel, into in ((src, src_err), (dst, dst_err)):  # the rest of each end's stderr, to its EOF
            while chunk := channel.recv_stderr(65536):
                into.append(chunk)
            channel.recv_exit_status()
    finally:
        src.close()
        dst.close()
    return total, digest.hexdigest(), b"".join(src_err).decode(errors="replace"), \
        b"".join(dst_err).decode(errors="replace")


def send_command(directory: str) -> str:
    """On the canary: tar the NUL-separated relative paths read from stdin, to stdout; its sha256 and tar's exit
    status to stderr."""
    d = shlex.quote(directory)
    return (f"cd {d} && {{ {{ tar --null -T - -cf -; echo \"tar-rc $?\" >&2; }} | tee /dev/fd/3 | sha256sum >&2; }} "
            "3>&1")


def receive_command(directory: str, tmp: str) -> str:
    """On the host: the stream unpacked into tmp (a new dir beside the cache dir, same filesystem), its sha256 and
    tar's exit status to stderr. Nothing lands in the cache dir itself."""
    t = shlex.quote(tmp)
    return (f"mkdir -m 700 {t} && {{ {{ tee /dev/fd/4 | sha256sum >&2; }} 4>&1 | tar -C {t} -xf -; "
            f"echo \"tar-rc $?\" >&2; }}")


def place_command(directory: str, tmp: str, roots: Sequence[str]) -> str:
    """Each unpacked root renamed into the cache dir unless the host has it by now; the temp dir removed."""
    d, t = shlex.quote(directory), shlex.quote(tmp)
    steps = [f"mkdir -p {d}"]
    for r in roots:
        dst, src = shlex.quote(f"{directory}/{r}"), shlex.quote(f"{tmp}/{r}")
        steps.append(f"if [ -e {dst} ] || [ -L {dst} ]; then echo {shlex.quote('present ' + r)}; "
                     f"else mkdir -p \"$(dirname {dst})\" && mv -T {src} {dst} && echo {shlex.quote('placed ' + r)}; fi")
    return "; ".join(steps) + f"; rm -rf {t}"


def temp_dir(directory: str) -> str:
    parent, name = posixpath.split(directory.rstrip("/"))
    return posixpath.join(parent or "/", f".{name}.gpufleet-carry-{uuid.uuid4().hex[:12]}")


@dataclass
class Carry:
    """The carry across one rollout's swap: before_canary() lists the canary's cache dir, after_canary() lists it
    again once it is committed, into() carries to a group before its swap, observe() reads each swapped host's
    start. results: {host: CarryResult}, for the report."""

    sessions: Sessions
    hosts: Mapping[str, FleetHost]
    note: Callable[[str], None] = lambda line: None
    tamper: Callable[[bytes], bytes] | None = None  # tests only: the bytes changed in flight
    turned_off: str | None = None  # why this rollout carries nothing by choice (`rollout --no-carry`); starts are
    # still observed, so the report says how each host started either way
    results: dict[str, CarryResult] = field(default_factory=dict)
    canary: str | None = None
    _before: dict[str, str] | None = None
    _files: list[str] = field(default_factory=list)
    _gpus: Gpus | str = "not read"
    _off: str | None = None  # why nothing is carried in this rollout

    def _list(self, host: str, directory: str) -> dict[str, str]:
        rc, out, err = run(self.sessions.get(host), listing_command(directory), timeout=LIST_TIMEOUT_S, root=True)
        if rc != 0:
            raise TransportError(one_line(f"cannot list {directory}: {(err or out).strip()[:160] or f'exit {rc}'}"))
        return parse_listing(out)

    def _gpus_of(self, host: str) -> Gpus | str:
        try:
            return parse_gpus(*run(self.sessions.get(host), GPU_QUERY, timeout=LIST_TIMEOUT_S))
        except TransportError as e:
            return one_line(str(e))

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
        self._files = new_files(self._before, after)
        self._gpus = self._gpus_of(canary)
        if not self._files:
            self._off = f"canary {canary} wrote no new entry in {directory}"
        self.results[canary] = CarryResult(entries=tuple(self._files), canary=True,
                                           skipped_reason=self._off)
        self.note(self._off or f"carrying {len(self._files)} new compile-cache file(s) from canary {canary} "
                  f"({directory}) to each later host before its swap")

    def into(self, group: Sequence[str]) -> None:
        for host in group:
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
        refusal = config_refusal(self.canary, self.hosts[self.canary].spec, self.hosts[host].spec) or \
            gpu_refusal(self.canary, self._gpus, self._gpus_of(host))
        if refusal is not None:
            return CarryResult(skipped_reason=refusal)
        tmp = temp_dir(directory)
        try:
            present = self._list(host, directory)
            roots = placements(self._files, present)
            if not roots:
                return CarryResult(skipped_reason="it has every entry already")
            files = files_under(self._files, roots)
            total, relayed, sent, received = relay(
                self.sessions.get(self.canary), send_command(source), "\0".join(files).encode() + b"\0",
                self.sessions.get(host), receive_command(directory, tmp), self.tamper)
            problem = stream_problem(sent, relayed, received)
            if problem is not None:
                self._remove(host, tmp)
                return CarryResult(skipped_reason=f"refused: {problem}")
            rc, out, err = run(self.sessions.get(host), place_command(directory, tmp, roots), timeout=LIST_TIMEOUT_S,
                               root=True)
        except (TransportError, OSError, paramiko.SSHException, EOFError) as e:
            self._remove(host, tmp)
            return CarryResult(skipped_reason=one_line(f"carry failed: {e}"))
        placed = tuple(line.removeprefix("placed ") for line in out.splitlines() if line.startswith("placed "))
        if rc != 0:
            return CarryResult(entries=placed, skipped_reason=one_line(
                f"putting the entries in place failed: {(err or out).strip()[:160] or f'exit {rc}'}"))
        return CarryResult(carried_bytes=total if placed else 0, entries=placed,
                           skipped_reason=None if placed else "it has every entry already")

    def _remove(self, host: str, tmp: str) -> None:
        """The temp dir gone, as far as the host can still be reached (a lost one keeps a hidden dir, never an entry
        in its cache dir)."""
        try:
            run(self.sessions.get(host), f"rm -rf {shlex.quote(tmp)}", timeout=LIST_TIMEOUT_S, root=True)
        except (TransportError, OSError, paramiko.SSHException, EOFError):
            pass

    def observe(self, group: Sequence[str]) -> None:
        """Each swapped host's start, from its container: warm or cold, and its time to ready."""
        for host in group:
            warm, took = self.start_of(host)
            prior = self.results.get(host, CarryResult(canary=host == self.canary))
            self.results[host] = CarryResult(prior.carried_bytes, prior.skipped_reason, prior.entries, warm, took,
                                             prior.canary)

    def start_of(self, host: str) -> tuple[bool | None, float | None]:
        try:
            transport = self.sessions.get(host)
            info = transport.container(self.hosts[host].spec.service)
            if info is None:
                return None, None
            sudo = "sudo -n " if needs_sudo(transport.client) else ""
            rc, out, _ = transport.run(f"{sudo}docker logs -t {shlex.quote(info.id)} 2>&1 | head -n 2000",
                                       timeout=LIST_TIMEOUT_S)
        except TransportError:
            return None, None
        return start_report(out.splitlines(), info.started_at) if rc == 0 else (None, None)

