"""The rollout's target: ONE digest for every host. A digest given as --image is used as it is; a tag (--image, or
the inventory's vllm_image) is resolved once, at the start, by pulling it on one host while the old version keeps
serving: every host then gets exactly that digest, even if the tag moves during the rollout."""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.errors import GpufleetError, one_line
from gpufleet.image_ref import parse
from gpufleet.operations.image import pick_digest
from gpufleet.remote.transport import TransportError
from gpufleet.rollout.fleet import FleetHost, Sessions, run

PULL_TIMEOUT_S = 3600.0  # a nightly vLLM image is ~10 GB


@dataclass(frozen=True)
class Target:
    ref: str  # repo@sha256:<digest>
    requested: str  # what named it: --image, or vllm_image
    resolved_on: str | None = None  # the host the tag was pulled on (None: a digest was given)


def repository(hosts: Sequence[FleetHost]) -> str:
    """The one repository every host's vllm_image names (a rollout moves one image across the fleet)."""
    repos = {h.name: ref.repository for h in hosts if (ref := parse(h.spec.image)) is not None}
    distinct = sorted(set(repos.values()))
    if len(distinct) != 1:
        listed = ", ".join(f"{name}: {repo}" for name, repo in repos.items())
        raise GpufleetError(one_line(f"vllm_image names {len(distinct)} repositories ({listed}) (fix: one "
                                     "inventory per repository, or one vllm_image for the fleet)"))
    return distinct[0]


def requested_image(hosts: Sequence[FleetHost], image: str | None) -> str:
    """--image, checked against the fleet's repository; else the inventory's vllm_image (one for all hosts)."""
    repo = repository(hosts)
    if image is None:
        images = sorted({h.spec.image for h in hosts})
        if len(images) != 1:
            raise GpufleetError(one_line(f"the hosts' vllm_image differ ({', '.join(images)}) (fix: pass --image)"))
        return images[0]
    ref = parse(image)
    if ref is None:
        raise GpufleetError(one_line(f"--image {image!r} is not an image reference (fix: use repo:tag or "
                                     "repo@sha256:<digest>)"))
    if ref.repository != repo:
        raise GpufleetError(one_line(f"--image {image} is not of the fleet's repository {repo} (fix: use "
                                     f"{repo}:<tag> or {repo}@sha256:<digest>, or change vllm_image)"))
    return image


def resolve_command(image: str) -> str:
    q = shlex.quote(image)
    return f"docker pull -q {q} >/dev/null && docker image inspect --format '{{{{json .RepoDigests}}}}' {q}"


def digest_from_inspect(image: str, rc: int, out: str, err: str, host: str) -> str:
    if rc != 0:
        raise GpufleetError(one_line(f"{host}: docker pull {image} failed: {(err or out).strip()[-300:]} (fix: check "
                                     "the tag exists in the registry and the host can reach it)"))
    try:
        digests = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        digests = None
    ref = pick_digest(image, digests) if isinstance(digests, list) else None
    if not ref:
        raise GpufleetError(one_line(f"{host}: {image} has no registry digest after the pull (fix: push it to a "
                                     "registry, or pass --image repo@sha256:<digest>)"))
    return ref


def resolve(hosts: Sequence[FleetHost], sessions: Sessions, image: str | None) -> Target:
    """The target digest; raises GpufleetError with one line."""
    requested = requested_image(hosts, image)
    pinned = parse(requested)
    if pinned is not None and pinned.pinned:
        return Target(pinned.pinned, requested)
    errors = []
    for host in hosts:  # the first host that answers resolves it; the others get it by digest in prepare
        try:
            rc, out, err = run(sessions.get(host.name), resolve_command(requested), timeout=PULL_TIMEOUT_S, root=True)
        except TransportError as e:  # unreachable: the next host resolves it
            errors.append(one_line(f"{host.name}: {e}"))
            continue
        return Target(digest_from_inspect(requested, rc, out, err, host.name), requested, host.name)
    raise GpufleetError(one_line(f"cannot resolve {requested}: no host could pull it ({'; '.join(errors)})"))
