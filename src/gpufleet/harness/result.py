"""The run's last lines: every host that failed or could not be reached, with its fix, after pyinfra's output.

Where RESULT_ENV names a file, the run also writes its result there for the rollout, as JSON:
{"finished": bool, "hosts": [{"host", "ok", "reached", "problems": [line, ...]}]}.
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from weakref import WeakSet

from pyinfra.api import Host, State
from pyinfra.api.state import StateStage

from gpufleet.errors import one_line
from gpufleet.operations.run import reported

HEADER = "host(s) did not converge:"
RESULT_ENV = "GPUFLEET_RUN_RESULT"
_REGISTERED: WeakSet[State] = WeakSet()  # one summary per run, however many deploy files register it


@dataclass(frozen=True)
class HostResult:
    """One host of a run: converged (ok), reached over SSH, and why not."""

    host: str
    ok: bool
    reached: bool
    problems: tuple[str, ...]

    def as_json(self) -> dict[str, object]:
        return {"host": self.host, "ok": self.ok, "reached": self.reached, "problems": list(self.problems)}


def lines(state: State) -> list[str]:
    out = []
    for host in state.inventory:
        if host not in state.failed_hosts:
            continue
        if host not in state.activated_hosts:
            out.append(_unreachable(host))
        else:
            out.append(
                f"{host.name}: failed; its error is in the [{host.name}] lines above (fix: correct what they "
                "name, then run again: a converge goes on from where the host stands)"
            )
    return out


def _unreachable(host: Host) -> str:
    return (
        f"{host.name}: could not be reached over SSH (fix: check that it is up and that `{_ssh_command(host)} "
        "true` logs in with the inventory's ssh_* settings, then run again)"
    )


def results(state: State) -> tuple[bool, list[HostResult]]:
    """(whether the run got through its operations, one HostResult per host of the run)."""
    finished = state.current_stage >= StateStage.Disconnect
    kept = reported(state)
    out = []
    for host in state.inventory:
        if not state.is_host_in_limit(host):
            continue
        reached, failed = host in state.activated_hosts, host in state.failed_hosts
        ok = reached and finished and not failed
        problems = [] if ok else kept.get(host.name, [])
        if not problems and not reached:
            problems = [_unreachable(host)]
        elif not problems and failed:
            problems = [_failed_operation(state, host)]
        out.append(HostResult(host.name, ok, reached, tuple(problems)))
    return finished, out


def _failed_operation(state: State, host: Host) -> str:
    """The first failed operation of the host, with its last line of stderr."""
    for op_hash in state.get_op_order():
        try:
            op_data = state.get_op_data_for_host(host, op_hash)
        except KeyError:
            continue
        meta = op_data.operation_meta
        if not meta.is_complete() or meta.did_succeed() or op_data.global_arguments.get("_ignore_errors"):
            continue
        name = ", ".join(sorted(state.get_op_meta(op_hash).names)) or "an operation"
        said = [line.strip() for line in meta.stderr_lines if line.strip()]
        why = f": {said[-1]}" if said else ""
        return one_line(f"{host.name}: {name!r} failed{why} (fix: its full error is in the deploy output, --log)")
    return f"{host.name}: failed; its error is in the deploy output (--log)"


def write_result(state: State, path: Path) -> None:
    finished, hosts = results(state)
    text = json.dumps({"finished": finished, "hosts": [h.as_json() for h in hosts]}, indent=1)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def read_result(path: Path) -> dict[str, HostResult] | None:
    """host -> its HostResult; None when the run wrote none, having died before its exit."""
    try:
        doc = json.loads(path.read_text())
        return {
            str(h["host"]): HostResult(
                str(h["host"]), h["ok"] is True, h["reached"] is True, tuple(str(p) for p in h["problems"])
            )
            for h in doc["hosts"]
        }
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _ssh_command(host: Host) -> str:
    user, port = host.data.get("ssh_user"), host.data.get("ssh_port")
    target = f"{user}@" if user else ""
    target += str(host.data.get("ssh_hostname") or host.name)
    return "ssh " + (f"-p {port} " if port and str(port) != "22" else "") + shlex.quote(target)


def print_at_exit(state: State) -> None:
    """At the process's exit, print lines(state) on stderr and write the result where RESULT_ENV says."""
    if state in _REGISTERED:
        return
    _REGISTERED.add(state)

    def summary() -> None:
        where = os.environ.get(RESULT_ENV)
        if where:
            try:
                write_result(state, Path(where))
            except Exception as error:  # the reader falls back to the exit code
                print(f"could not write the run's result to {where}: {one_line(str(error))}", file=sys.stderr)
        try:
            failed = lines(state)
        except Exception:  # the state half gone after an abnormal API run
            return
        if failed:
            print(f"\n{len(failed)} {HEADER}", file=sys.stderr)
            for line in failed:
                print(f"  {line}", file=sys.stderr)

    atexit.register(summary)
