"""Does a new image's own `vllm serve` parser accept the spec's flags? Nightly images rename and drop flags.

A rejection exits 2 before any model work; an accepted command line fails at the placeholder model path.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.errors import one_line
from gpufleet.hoststate.paths import STATE_DIR
from gpufleet.operations.base import Commands, fail
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.operations.image import target_ref
from gpufleet.vllm.spec import FLAG_CHECK_MODEL, ServeSpec

TIMEOUT_S = 120  # importing torch takes tens of seconds on a busy host
RC_MARK = "gpufleet-flagcheck-rc="
# "vllm serve: error: argument --kv-cache-dtype: invalid choice: ..." or "vllm: error: unrecognized arguments: ..."
_ERROR = re.compile(r"^(?P<prog>[\w .-]+): error: (?P<message>.+)$", re.MULTILINE)
_ARGUMENT = re.compile(r"^argument (?P<flag>[^:]+): ")


@dataclass(frozen=True)
class Accepted:
    pass


@dataclass(frozen=True)
class Rejected:
    flags: tuple[str, ...]  # as the parser named them: "--a", "--b/-b"
    message: str


@dataclass(frozen=True)
class Inconclusive:
    reason: str


Verdict = Accepted | Rejected | Inconclusive


def verdict(rc: int, output: str) -> Verdict:
    """What the image's parser said, from the check's exit status and output."""
    errors = list(_ERROR.finditer(output))
    if rc == 2 and errors:
        message = errors[-1].group("message").strip()
        if message.startswith("unrecognized arguments: "):
            flags = tuple(a for a in message.split(": ", 1)[1].split() if a.startswith("-"))
        else:
            named = _ARGUMENT.match(message)
            flags = (named.group("flag"),) if named else ()
        return Rejected(flags, message)
    if rc in (124, 137):
        return Inconclusive(f"the image's parser gave no verdict within {TIMEOUT_S} s")
    if rc in (125, 126, 127):
        return Inconclusive(f"docker could not run the image (exit {rc}): {_last_lines(output)}")
    if FLAG_CHECK_MODEL in output:
        return Accepted()
    return Inconclusive(f"exit {rc} before model resolution: {_last_lines(output)}")


def _last_lines(output: str, n: int = 2) -> str:
    return one_line(" | ".join(line for line in output.strip().splitlines()[-n:])) or "no output"


def check_command(spec: ServeSpec, ref: str) -> str:
    """The check bounded in time, its exit status printed last since pyinfra reports only ok or not."""
    name = f"gpufleet-flagcheck-{spec.service}"
    run = " ".join(shlex.quote(a) for a in spec.flag_check_argv(ref, name))
    quoted = shlex.quote(name)
    return (
        f"docker rm -f {quoted} >/dev/null 2>&1; timeout -k 5 {TIMEOUT_S} {run} 2>&1; rc=$?; "
        f"if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then docker rm -f {quoted} >/dev/null 2>&1; fi; "
        f"echo {RC_MARK}$rc"
    )


def rejection_line(host_name: str, ref: str, rejected: Rejected) -> str:
    flags = ", ".join(rejected.flags) or "a flag"
    return one_line(
        f"{host_name}: image {ref} rejects {flags} of vllm_args: {rejected.message} (fix: remove or "
        "rename the flag in vllm_args for this image, or roll out another image; nothing was changed)"
    )


def accepted_file(service: str) -> str:
    """The last accepted digest and spec hash: a swap skips what its prepare checked."""
    return f"{STATE_DIR}/{service}.flags-accepted"


def _check(state: State, host: Host, spec: ServeSpec, committed_ref: str | None, pin: str | None) -> bool:
    ref = target_ref(pin, host) or spec.image
    if ref == committed_ref:
        return True
    sudo, noted = use_sudo(host), shlex.quote(accepted_file(spec.service))
    key = f"{ref} {spec.spec_hash}"
    ok, output = host.run_shell_command(f"cat {noted} 2>/dev/null || true", _sudo=sudo)
    if ok and key in output.stdout_lines:
        host.log_styled(f"{ref.rsplit('@', 1)[-1][:19]} accepted the serve flags in an earlier run (same spec)")
        return True
    ok, output = host.run_shell_command(check_command(spec, ref), _sudo=sudo)
    lines = output.stdout_lines
    mark = lines[-1] if lines and lines[-1].startswith(RC_MARK) else None
    if not ok or mark is None:
        return fail(host, f"{host.name}: the flag check of {ref} could not run: {_last_lines(output.stderr)}")
    result = verdict(int(mark[len(RC_MARK) :]), "\n".join(lines[:-1]))
    if isinstance(result, Rejected):
        return fail(host, rejection_line(host.name, ref, result))
    if isinstance(result, Inconclusive):
        return fail(
            host,
            f"{host.name}: cannot tell whether image {ref} accepts vllm_args: {result.reason} "
            "(fix: `docker run --rm " + ref + " --help` on the host; nothing was changed)",
        )
    host.log_styled(f"{ref.rsplit('@', 1)[-1][:19]} accepts the serve flags")
    # A note, not state: lost or torn, the next run checks again.
    host.run_shell_command(f"mkdir -p {shlex.quote(STATE_DIR)} && echo {shlex.quote(key)} > {noted}", _sudo=sudo)
    return True


@operation()
def accepts_flags(spec: ServeSpec, committed_ref: str | None, pin: str | None) -> Commands:
    """Fail the host when the image the unit will run rejects the spec's serve flags."""
    ref = target_ref(pin)
    if ref is not None and ref == committed_ref:
        host.noop(f"{ref.rsplit('@', 1)[-1][:19]} is the committed image: its flags were verified")
        return
    # The digest may be known only after the pull.
    yield FunctionCommand(_check, (spec, committed_ref, pin), {})
