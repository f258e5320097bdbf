"""The run's last lines: every host that failed or could not be reached, each with its fix, printed after pyinfra's
own results. pyinfra names an unreachable host only in its early connect line, and a failed one in the middle of its
operations' output; a user should not have to scroll back to find either."""

from __future__ import annotations

import atexit
import shlex
import sys
from weakref import WeakSet

from pyinfra.api import Host, State

HEADER = "host(s) did not converge:"  # after "<N> ", the summary's first line
_REGISTERED: WeakSet[State] = WeakSet()  # one summary per run, however many deploy files register it


def lines(state: State) -> list[str]:
    """One line per failed host, in inventory order: why, and what to do about it."""
    out = []
    for host in state.inventory:
        if host not in state.failed_hosts:
            continue
        if host not in state.activated_hosts:
            out.append(f"{host.name}: could not be reached over SSH (fix: check that it is up and that "
                       f"`{_ssh_command(host)} true` logs in with the inventory's ssh_* settings, then run again)")
        else:
            out.append(f"{host.name}: failed; its error is in the [{host.name}] lines above (fix: correct what they "
                       "name, then run again: a converge goes on from where the host stands)")
    return out


def _ssh_command(host: Host) -> str:
    user, port = host.data.get("ssh_user"), host.data.get("ssh_port")
    target = f"{user}@" if user else ""
    target += str(host.data.get("ssh_hostname") or host.name)
    return "ssh " + (f"-p {port} " if port and str(port) != "22" else "") + shlex.quote(target)


def print_at_exit(state: State) -> None:
    """Print lines(state) on stderr when the run's process ends (pyinfra exits 1 when a host failed)."""
    if state in _REGISTERED:
        return
    _REGISTERED.add(state)

    def summary() -> None:
        try:
            failed = lines(state)
        except Exception:  # the run's state half gone at exit (an API run that ended abnormally): nothing to say
            return
        if failed:
            print(f"\n{len(failed)} {HEADER}", file=sys.stderr)
            for line in failed:
                print(f"  {line}", file=sys.stderr)

    atexit.register(summary)


def without_summary(output: str) -> str:
    """A run's output up to its summary: what the hosts and pyinfra said, for a reader that looks for them."""
    head, found, _ = output.rpartition(f" {HEADER}\n")
    return head.rpartition("\n")[0] if found else output
