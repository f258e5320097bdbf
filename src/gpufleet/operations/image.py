"""The serving image: pulled, its tag resolved to a digest; the unit runs the digest.

A tag is resolved once: the host's ledger (gpufleet.ledger, /var/lib/gpufleet/<service>.json) records the digest
each version ran, and later converges reuse it (a reboot or a re-converge never silently moves to a newer nightly).
Changing vllm_image resolves again; `gpufleet_image_ref` installs a given digest of the same repository instead.
This module writes no ledger: a resolved digest lives in this run's memory (gpufleet.operations.snapshot) until the
unit that runs it is begun (gpufleet.operations.service), so a run that fails after the pull leaves the ledger
naming what runs.
"""

from __future__ import annotations

import json
import shlex
import time

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.image_ref import parse
from gpufleet.ledger import Ledger, pin
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.snapshot import memo
from gpufleet.remote.ssh import use_sudo


def repository(image: str) -> str:
    """The repository as docker lists it: "reg:5000/vllm/vllm-openai:nightly" -> "reg:5000/vllm/vllm-openai" (a
    registry port is not a tag), "docker.io/library/ubuntu:24.04" -> "ubuntu"."""
    ref = parse(image)
    if ref is not None:
        return ref.repository
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def pinned_ref(ledger: Ledger | None, image: str, image_ref_setting: str | None = None) -> str | None:
    """The digest this run installs for `image` when it is known before any pull: gpufleet_image_ref, a digest in
    the image setting itself, or the one the ledger has for this exact image setting (ledger.pin)."""
    if image_ref_setting:
        return image_ref_setting
    ref = parse(image)
    if ref is not None and ref.pinned:
        # Pinned by the user; "repo:tag@sha256:..." runs (and is listed by docker) as "repo@sha256:...".
        return ref.pinned
    return pin(ledger or Ledger(), image)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pick_digest(image: str, repo_digests: list[str]) -> str | None:
    """The entry of `docker image inspect`'s RepoDigests that belongs to image's repository."""
    repo = repository(image)
    return next((d for d in repo_digests if repository(d.split("@", 1)[0]) == repo), None)


def image_present(images: list[tuple[str, str, str]], ref: str) -> bool:
    """Is `repo@sha256:...` among `docker images --digests` (repository, tag, digest) rows? Both sides are
    normalised: docker lists Docker Hub images by their short names."""
    repo, _, digest = ref.partition("@")
    repo = repository(repo)
    return bool(digest) and any(d == digest and repository(r) == repo for r, _, d in images)


def _pull(state: State, host: Host, image: str, pull: str) -> bool:
    sudo = use_sudo(host)
    # print_output: docker's per-layer progress lines stream to the terminal as they come.
    ok, output = host.run_shell_command(f"docker pull {shlex.quote(pull)}", _sudo=sudo, print_output=True)
    if not ok:
        return fail(host, f"docker pull {pull} failed: {' | '.join(output.output_lines[-3:])}")
    ok, output = host.run_shell_command(
        f"docker image inspect --format '{{{{json .RepoDigests}}}}' {shlex.quote(pull)}", _sudo=sudo)
    ref = pick_digest(pull, json.loads(output.stdout or "[]")) if ok else None
    if not ref:
        return fail(host, f"{image} has no registry digest after the pull (fix: pull it from a registry, "
                          "or set vllm_image to repo@sha256:<digest>)")
    memo(host).resolved_image_ref = ref  # for the unit, the flag check and the model download
    host.log_styled(f"pinned {image} -> {ref}")
    return True


def image_ref(image: str, host: Host | None = None) -> str | None:
    """The digest ref the unit must run: resolved by pinned() while executing, or known before this deploy
    (gpufleet_image_ref, or the ledger's pin for this image setting)."""
    held = memo(host)
    return held.resolved_image_ref or held.pin or pinned_ref(held.ledger, image)


@operation()
def pinned(image: str, ref: str | None) -> Commands:
    """Pull the image (by `ref`, the digest this run installs, when known) and resolve its tag to a digest."""
    snap = memo().snapshot
    if ref and image_present(snap.images, ref):
        host.noop(f"{image} is pinned to {ref.rsplit('@', 1)[1][:19]} and present")
        return
    # A known digest whose image is missing is pulled by digest: the pin does not move.
    yield FunctionCommand(_pull, (image, ref or image), {})
