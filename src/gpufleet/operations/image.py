"""The serving image: pulled, its tag resolved to a digest, recorded on the host; the unit runs the digest.

State file /var/lib/gpufleet/<service>.json:
    {"current": {"image": "repo:tag", "ref": "repo@sha256:...", "pinned_at": "..."},
     "previous": {...} | null, "history": [{...}, ...]}
"current" is what the unit runs. A rollback (gpufleet.deploys.verify) puts the entry that was serving back as
"current" and marks the failed attempt in "history" with "failed" (the reason) and "failed_at".
A tag is resolved once: later converges reuse the recorded digest (so a reboot or a re-converge never silently
moves to a newer nightly). Changing vllm_image, or removing the state file, resolves again.
"""

from __future__ import annotations

import json
import shlex
import time
from io import BytesIO
from typing import Any

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.image_ref import parse
from gpufleet.operations.layout import STATE_DIR
from gpufleet.operations.remote import Commands, fail, use_sudo
from gpufleet.operations.snapshot import memo

HISTORY_LIMIT = 20


def repository(image: str) -> str:
    """The repository as docker lists it: "reg:5000/vllm/vllm-openai:nightly" -> "reg:5000/vllm/vllm-openai" (a
    registry port is not a tag), "docker.io/library/ubuntu:24.04" -> "ubuntu"."""
    ref = parse(image)
    if ref is not None:
        return ref.repository
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def pinned_ref(state: dict[str, Any] | None, image: str) -> str | None:
    """The digest ref recorded for this exact image setting, if any."""
    ref = parse(image)
    if ref is not None and ref.pinned:
        # Pinned by the user; "repo:tag@sha256:..." runs (and is listed by docker) as "repo@sha256:...".
        return ref.pinned
    current = (state or {}).get("current") or {}
    if current.get("image") == image and isinstance(current.get("ref"), str) and "@sha256:" in current["ref"]:
        return current["ref"]
    return None


def record(state: dict[str, Any] | None, image: str, ref: str, now: str) -> dict[str, Any]:
    """The state file's new content after pinning `image` to `ref`."""
    state = dict(state or {})
    current = state.get("current")
    if current and current.get("ref") == ref and current.get("image") == image:
        return state
    entry = {"image": image, "ref": ref, "pinned_at": now}
    history = [*(state.get("history") or []), entry][-HISTORY_LIMIT:]
    return {"current": entry, "previous": current, "history": history}


def rolled_back(state: dict[str, Any] | None, failed_ref: str, restored: dict[str, Any], reason: str,
                now: str) -> dict[str, Any]:
    """The state file's content after the unit went back to `restored` (the entry that was current before the
    failed attempt): the newest history entry for `failed_ref` is marked failed; "previous" becomes the newest
    earlier entry that neither failed nor is the restored one (the next thing to fall back to)."""
    state = dict(state or {})
    history = [dict(entry) for entry in state.get("history") or []]
    for entry in reversed(history):
        if entry.get("ref") == failed_ref:
            entry.update(failed=reason, failed_at=now)
            break
    previous = next((e for e in reversed(history)
                     if not e.get("failed") and e.get("ref") != restored.get("ref")), None)
    return {"current": dict(restored), "previous": previous, "history": history}


def write_state(host: Host, path: str, state: dict[str, Any]) -> bool:
    """Upload the state file (root-owned, in STATE_DIR) from a FunctionCommand."""
    content = json.dumps(state, indent=2) + "\n"
    sudo = use_sudo(host)
    ok = host.run_shell_command(f"install -d -m 755 {shlex.quote(STATE_DIR)}", _sudo=sudo)[0]
    return bool(ok and host.put_file(BytesIO(content.encode()), path, _sudo=sudo))


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


def _pull_and_pin(state: State, host: Host, image: str, pull: str, path: str, previous: dict[str, Any] | None) -> bool:
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
    memo(host).resolved_image_ref = ref  # for the unit and the model download (gpufleet.operations.snapshot)
    if not write_state(host, path, record(previous, image, ref, now_utc())):
        return fail(host, f"could not write {path}")
    host.log_styled(f"pinned {image} -> {ref}")
    return True


def image_ref(image: str, host: Host | None = None) -> str | None:
    """The digest ref the unit must run: resolved by pinned() while executing, or recorded before this deploy."""
    held = memo(host)
    return held.resolved_image_ref or pinned_ref(held.snapshot.state, image)


@operation()
def pinned(image: str, state_file: str) -> Commands:
    """Pull the image and pin its tag to a digest, recorded in state_file."""
    snap = memo().snapshot
    ref = pinned_ref(snap.state, image)
    if ref and image_present(snap.images, ref):
        host.noop(f"{image} is pinned to {ref.rsplit('@', 1)[1][:19]} and present")
        return
    # A recorded digest whose image went missing is pulled by digest: the pin does not move.
    yield FunctionCommand(_pull_and_pin, (image, ref or image, state_file, snap.state), {})
