"""The rollout's one target digest: as given, or a tag looked up once on one host (docs/rollout.md)."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.errors import GpufleetError, one_line
from gpufleet.image_names import parse
from gpufleet.remote.transport import SshTransport, TransportError
from gpufleet.rollout.hosts import FleetHost, Sessions, shell
from gpufleet.vllm import weights
from gpufleet.vllm.operations.image import pick_digest
from gpufleet.vllm.settings import merged_settings
from gpufleet.vllm.unit import env_file_path

PULL_TIMEOUT_S = 3600.0  # a nightly vLLM image is ~10 GB
LOOKUP_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 60.0

BUILDX, MANIFEST = "buildx", "manifest"
TOOL_NAMES = {BUILDX: "docker buildx imagetools inspect", MANIFEST: "docker manifest inspect"}
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Target:
    ref: str  # repo@sha256:<digest>
    requested: str  # --image, or vllm_image
    resolved_on: str | None = None  # None when a digest was given
    tool: str | None = None  # None: the tag was pulled, see pulled_because
    pulled_because: str | None = None

    @property
    def where(self) -> str:
        """How the tag became this digest, for the progress."""
        if self.resolved_on is None:
            return ""
        if self.tool is not None:
            return f"looked up on {self.resolved_on} with {TOOL_NAMES[self.tool]}: nothing pulled"
        return f"pulled on {self.resolved_on}: {self.pulled_because or 'no registry lookup'}"


def fleet_repository(hosts: Sequence[FleetHost]) -> str:
    """The one repository every host's vllm_image names."""
    repos = {h.name: ref.repository for h in hosts if (ref := parse(h.spec.image)) is not None}
    distinct = sorted(set(repos.values()))
    if len(distinct) != 1:
        listed = ", ".join(f"{name}: {repo}" for name, repo in repos.items())
        raise GpufleetError(
            one_line(
                f"vllm_image names {len(distinct)} repositories ({listed}) (fix: one "
                "inventory per repository, or one vllm_image for the fleet)"
            )
        )
    return distinct[0]


def requested_image(hosts: Sequence[FleetHost], image: str | None) -> str:
    """--image, checked against the fleet's repository, else the inventory's one vllm_image."""
    repo = fleet_repository(hosts)
    if image is None:
        images = sorted({h.spec.image for h in hosts})
        if len(images) != 1:
            raise GpufleetError(one_line(f"the hosts' vllm_image differ ({', '.join(images)}) (fix: pass --image)"))
        return images[0]
    ref = parse(image)
    if ref is None:
        raise GpufleetError(
            one_line(f"--image {image!r} is not an image reference (fix: use repo:tag or repo@sha256:<digest>)")
        )
    if ref.repository != repo:
        raise GpufleetError(
            one_line(
                f"--image {image} is not of the fleet's repository {repo} (fix: use "
                f"{repo}:<tag> or {repo}@sha256:<digest>, or change vllm_image)"
            )
        )
    return image


# --- the registry lookup -------------------------------------------------------------------------------------------
# Which lookup tools work (a broken buildx plugin fails `version`), and dockerd's registry settings.
PROBE_COMMAND = (
    "docker buildx version >/dev/null 2>&1 && echo tool=buildx; "
    "docker manifest inspect --help >/dev/null 2>&1 && echo tool=manifest; "
    "echo registry-config=$(docker info --format '{{json .RegistryConfig}}' 2>/dev/null)"
)


@dataclass(frozen=True)
class Probe:
    tools: frozenset[str]
    registry_config: Mapping[str, Any] | None  # `docker info`'s RegistryConfig


def parse_probe(out: str) -> Probe:
    tools, config = set(), None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key == "tool" and value.strip() in TOOL_NAMES:
            tools.add(value.strip())
        elif key == "registry-config":
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = None
            config = parsed if isinstance(parsed, dict) else None
    return Probe(frozenset(tools), config)


def registry_of(image: str) -> str:
    """The registry host[:port] docker contacts for `image`."""
    first, slash, _ = image.partition("/")
    return first if slash and ("." in first or ":" in first or first == "localhost") else "docker.io"


def _host_part(registry: str) -> str:
    if registry.startswith("["):  # [v6]:port
        return registry[1:].split("]", 1)[0]
    return registry.rsplit(":", 1)[0] if ":" in registry else registry


def insecure(registry: str, config: Mapping[str, Any] | None) -> bool:
    """Whether dockerd's pull treats `registry` as insecure. A host name is not resolved, as dockerd would: one in
    an insecure CIDR needs its own entry."""
    if not config:
        return False
    index = (config.get("IndexConfigs") or {}).get(registry)
    if isinstance(index, dict) and isinstance(index.get("Secure"), bool):
        return not index["Secure"]
    host = _host_part(registry)
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        return False
    for cidr in config.get("InsecureRegistryCIDRs") or []:
        try:
            if address in ipaddress.ip_network(str(cidr), strict=False):
                return True
        except ValueError:
            continue
    return False


def tool_order(probe: Probe, image: str) -> list[str]:
    """Buildx first, as it pins multi-platform lists; for an insecure registry `docker manifest --insecure` first."""
    order = [MANIFEST, BUILDX] if insecure(registry_of(image), probe.registry_config) else [BUILDX, MANIFEST]
    return [t for t in order if t in probe.tools]


def lookup_command(tool: str, image: str, insecure_registry: bool = False) -> str:
    q = shlex.quote(image)
    if tool == BUILDX:
        return f"timeout {LOOKUP_TIMEOUT_S} docker buildx imagetools inspect --format '{{{{json .Manifest}}}}' {q}"
    return f"timeout {LOOKUP_TIMEOUT_S} docker manifest inspect -v{' --insecure' if insecure_registry else ''} {q}"


class MultiPlatform(Exception):
    """A multi-platform list whose own digest this tool does not print."""


def _digest(value: object) -> str | None:
    return value if isinstance(value, str) and _DIGEST.fullmatch(value) else None


def digest_from_lookup(tool: str, out: str) -> str:
    """The digest `docker pull` pins for the tag; raises MultiPlatform or ValueError."""
    doc = json.loads(out)
    if tool == BUILDX:  # {"mediaType", "digest", ...}
        digest = _digest(doc.get("digest")) if isinstance(doc, dict) else None
    elif isinstance(doc, list):  # one entry per platform; the list's own digest is not among them
        platforms = f"{len(doc)} platform{'' if len(doc) == 1 else 's'}"
        raise MultiPlatform(f"a multi-platform list ({platforms}), whose digest {TOOL_NAMES[tool]} does not print")
    else:  # {"Ref", "Descriptor": {"digest", ...}, "SchemaV2Manifest" | "OCIManifest"}
        descriptor = doc.get("Descriptor") if isinstance(doc, dict) else None
        digest = _digest(descriptor.get("digest")) if isinstance(descriptor, dict) else None
    if digest is None:
        raise ValueError(f"no digest in {TOOL_NAMES[tool]}'s output: {out.strip()[:120]!r}")
    return digest


# What a failed lookup said, in docker's and buildx's words -> the fix; the first match wins.
_FIXES = (
    (
        re.compile(
            r"unauthori[sz]ed|authentication required|access to the resource is denied|\b40[13]\b|forbidden|"
            r"no basic auth",
            re.I,
        ),
        "the registry refused the lookup: log in as root on {host} (`docker login {registry}`; prepare's pull uses "
        "the same credentials); Docker Hub answers so for a repository that does not exist too",
    ),
    (
        re.compile(r"no such manifest|manifest unknown|\bnot found\b|\b404\b|name unknown", re.I),
        "check that the tag exists in {registry}: push it, or pass --image with an existing tag or a digest",
    ),
    (
        re.compile(
            r"dial tcp|connection refused|no such host|i/o timeout|timed out|no answer within|network is "
            r"unreachable|\btls\b|x509|certificate|HTTP response to HTTPS client|error pinging|\bEOF\b",
            re.I,
        ),
        "check that {host} reaches {registry} (DNS, proxy, firewall); a plain-HTTP registry must be in dockerd's "
        "insecure-registries there, as the pull needs",
    ),
)


def lookup_error(tool: str, image: str, host: str, rc: int, out: str, err: str) -> str:
    said = (
        f"no answer within {LOOKUP_TIMEOUT_S} s"
        if rc == 124
        else (" ".join((err or out).split())[-300:] or f"exit status {rc}")
    )
    fix = next(
        (f for pattern, f in _FIXES if pattern.search(said)),
        "check the registry and docker on {host}, or pass --image repo@sha256:<digest>",
    )
    return one_line(
        f"{host}: cannot look up {image} in its registry ({TOOL_NAMES[tool]}): {said} (fix: "
        f"{fix.format(host=host, registry=registry_of(image))})"
    )


def _resolve_on(session: SshTransport, host: str, image: str, repo: str) -> Target:
    """Raises GpufleetError for the registry's refusal, TransportError when the host cannot be used."""
    rc, out, err = shell(session, PROBE_COMMAND, timeout=PROBE_TIMEOUT_S, root=True)
    if rc != 0:  # it ends with an echo: only a refused sudo fails it
        raise GpufleetError(
            one_line(
                f"{host}: cannot run docker as root to look up {image}: "
                f"{(err or out).strip()[-200:]} (fix: let the SSH user run sudo -n, as the "
                "deploy needs)"
            )
        )
    probe = parse_probe(out)
    listed, failures = None, []
    for tool in tool_order(probe, image):
        command = lookup_command(tool, image, insecure(registry_of(image), probe.registry_config))
        rc, out, err = shell(session, command, timeout=LOOKUP_TIMEOUT_S + 30, root=True)
        if rc != 0:
            failures.append(lookup_error(tool, image, host, rc, out, err))
            continue
        try:
            return Target(f"{repo}@{digest_from_lookup(tool, out)}", image, host, tool)
        except MultiPlatform as e:
            listed = f"{image} is {e}"
        except ValueError as e:
            failures.append(one_line(f"{host}: {e}"))
    if failures and listed is None:  # the registry refused: a pull would fail too
        raise GpufleetError(failures[0])
    if listed is not None:
        because = (
            f"{listed}, and docker buildx imagetools failed: {failures[0]}"
            if failures
            else f"{listed}, and docker buildx imagetools is not there (fix: install docker-buildx-plugin)"
        )
    else:
        because = (
            "neither docker buildx imagetools nor docker manifest inspect works there (fix: install "
            "docker-buildx-plugin)"
        )
    rc, out, err = shell(session, resolve_command(image), timeout=PULL_TIMEOUT_S, root=True)
    return Target(digest_from_inspect(image, rc, out, err, host), image, host, None, one_line(because))


# --- the fallback: a pull ------------------------------------------------------------------------------------------
def resolve_command(image: str) -> str:
    q = shlex.quote(image)
    return f"docker pull -q {q} >/dev/null && docker image inspect --format '{{{{json .RepoDigests}}}}' {q}"


def digest_from_inspect(image: str, rc: int, out: str, err: str, host: str) -> str:
    if rc != 0:
        raise GpufleetError(
            one_line(
                f"{host}: docker pull {image} failed: {(err or out).strip()[-300:]} (fix: check "
                "the tag exists in the registry and the host can reach it)"
            )
        )
    try:
        digests = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        digests = None
    ref = pick_digest(image, digests) if isinstance(digests, list) else None
    if not ref:
        raise GpufleetError(
            one_line(
                f"{host}: {image} has no registry digest after the pull (fix: push it to a "
                "registry, or pass --image repo@sha256:<digest>)"
            )
        )
    return ref


def resolve(hosts: Sequence[FleetHost], sessions: Sessions, image: str | None) -> Target:
    """The target digest; pulls nothing where the host has a lookup tool."""
    requested = requested_image(hosts, image)
    pinned = parse(requested)
    if pinned is not None and pinned.pinned:
        return Target(pinned.pinned, requested)
    repo = pinned.repository if pinned is not None else fleet_repository(hosts)
    errors = []
    for host in hosts:  # the first host that answers
        try:
            return _resolve_on(sessions.get(host.name), host.name, requested, repo)
        except TransportError as e:
            errors.append(one_line(f"{host.name}: {e}"))
    raise GpufleetError(
        one_line(f"cannot resolve {requested}: no host could be reached to look it up ({'; '.join(errors)})")
    )


def resolve_model(hosts: Sequence[FleetHost], sessions: Sessions, revision: str) -> str:
    """The sha that `revision` of vllm_model_repo names now, asked of the hub from the first host that answers."""
    settings = merged_settings(dict(hosts[0].data))
    repo, hub = settings["vllm_model_repo"], settings["vllm_hf_endpoint"]
    if not repo:
        raise GpufleetError(
            "--model-revision: vllm_model_repo is None, so there is no model to move (fix: set "
            "vllm_model_repo, or leave out --model-revision)"
        )
    if weights.MODEL_SHA.fullmatch(revision):
        return revision
    env = env_file_path(hosts[0].spec.service) if settings["vllm_hf_token"] else None
    command = weights.fetch_info_command(weights.info_url(hub, repo, revision), env)
    errors = []
    for host in hosts:
        try:
            rc, out, err = shell(sessions.get(host.name), command, timeout=LOOKUP_TIMEOUT_S, root=True)
        except TransportError as e:
            errors.append(one_line(f"{host.name}: {e}"))
            continue
        try:
            if rc == 0:
                return weights.parse_info(repo, out).sha
        except ValueError as e:
            err = str(e)
        raise GpufleetError(
            one_line(
                f"{host.name}: cannot read {repo} at {revision} from the hub {hub}: "
                f"{(err or out).strip()[-300:]} (fix: check the revision exists and the host "
                "reaches vllm_hf_endpoint)"
            )
        )
    raise GpufleetError(
        one_line(f"cannot resolve {repo} at {revision}: no host could be reached ({'; '.join(errors)})")
    )
