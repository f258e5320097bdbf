"""The apt repos' signing keys: when one is fetched and installed (docs/deploy.md, "Repo keys")."""

from __future__ import annotations

import base64
import binascii
import shlex
from collections.abc import Callable

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, State

from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import put_content, sha256, upload
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.facts import HostSnapshot


def dearmor(armored: str) -> bytes:
    """`gpg --dearmor` in Python: the host needs no gnupg."""
    lines = armored.strip().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN PGP PUBLIC KEY BLOCK"))
        end = next(i for i, line in enumerate(lines) if line.startswith("-----END PGP PUBLIC KEY BLOCK"))
    except StopIteration:
        raise ValueError("not an ASCII-armored PGP public key block") from None
    body = lines[start + 1 : end]
    if "" in body:  # armor headers end at the first blank line
        body = body[body.index("") + 1 :]
    body = [line.strip() for line in body if line.strip() and not line.startswith("=")]
    try:
        return base64.b64decode("".join(body), validate=True)
    except binascii.Error as error:
        raise ValueError(f"bad base64 in the armored key: {error}") from None


def fetch_key_command(url: str) -> str:
    # A setting: quoted, never shell syntax.
    return f"curl -fsSL --max-time 60 {shlex.quote(url)}"


def install_fetched_key(
    state: State,
    host: Host,
    url: str,
    path: str,
    as_file: Callable[[str], bytes],
    installed_sha256: str | None,
    setting: str,
) -> bool:
    """Make `path` hold as_file() of the key fetched from `url`; a failed fetch fails the host, as apt needs it."""
    ok, output = host.run_shell_command(fetch_key_command(url))
    try:
        if not ok:
            raise ValueError(" ".join(output.stderr_lines).strip()[:200] or "curl failed")
        content = as_file("\n".join(output.stdout_lines).strip() + "\n")
    except ValueError as error:
        return fail(
            host,
            f"{host.name}: could not fetch the repo key {url}: {error} (fix: make {url} reachable "
            f"from {host.name}, or set {setting} to a mirror that serves it)",
        )
    if sha256(content) == installed_sha256:
        return True
    return bool(upload(host, content, path, mode="0644", _sudo=use_sudo(host)))


def key_commands(
    snap: HostSnapshot,
    path: str,
    served: bytes | None,
    fetch: FunctionCommand,
    apt_reads_repo: bool,
    refresh: bool,
    url: str,
) -> Commands:
    """Keep a repo's key file current from `served`, the key the snapshot fetched, else by `fetch`."""
    if served is not None:
        yield from put_content(path, served)
    elif path not in snap.file_sha256 or apt_reads_repo:
        yield fetch
    elif refresh and host.state.is_executing:  # a plan that checks for changes runs this too
        host.log_styled(
            f"{host.name}: could not fetch {url} to check for a rotated key; kept the installed {path}",
            fg="yellow",
            log_func=logger.warning,
        )
