"""The serving image: pulled, its tag resolved to a digest; the unit runs the digest.

A tag is resolved once: the host's ledger (gpufleet.hoststate.ledger, /var/lib/gpufleet/<service>.json) records the digest
each version ran, and later converges reuse it (a reboot or a re-converge never silently moves to a newer nightly).
Changing vllm_image resolves again; `gpufleet_image_ref` installs a given digest of the same repository instead.
This module writes no ledger: a resolved digest lives in this run's state (gpufleet.operations.run, which says why it
cannot be an argument) until the unit that runs it is begun (gpufleet.vllm.operations.service), so a run that fails
after the pull leaves the ledger naming what runs. The pin (the digest known before the pull) is an argument.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.errors import one_line
from gpufleet.facts import pull as pull_facts
from gpufleet.facts.pull import PullStats
from gpufleet.hoststate.ledger import Ledger, pin
from gpufleet.hoststate.paths import STATE_DIR
from gpufleet.image_names import parse, repository
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import write_file
from gpufleet.operations.run import host_run
from gpufleet.remote.ssh import use_sudo
from gpufleet.sitecache.operations import STORAGE, CachePull
from gpufleet.vllm.snapshot import snapshot


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


def pull_stats_file(service: str) -> str:
    """Where a host keeps what its last pull moved (gpufleet.facts.pull.PullStats as JSON); the rollout reads it.
    Not *.json: the snapshot reads the state dir's JSON files as ledgers."""
    return f"{STATE_DIR}/{service}.pull"


TIMED_OUT = "@@gpufleet:timed-out"
WARM_STALL_S = 60  # seconds the cache's storage may stand still while it fetches an image from upstream


def run_bounded(host: Host, command: str, timeout_s: float | None = None) -> tuple[bool, list[str]]:
    """A docker command's success and every line it printed (stdout and stderr: docker's errors are on stderr);
    past timeout_s it is ended and its last line is TIMED_OUT."""
    if timeout_s:
        command = (f"timeout -k 10 {max(1, int(timeout_s))} {command} || {{ rc=$?; [ $rc -ne 124 ] || "
                   f"echo {TIMED_OUT}; exit $rc; }}")
    # print_output: docker's per-layer progress lines stream to the terminal as they come.
    ok, output = host.run_shell_command(command, _sudo=use_sudo(host), print_output=True)
    return bool(ok), output.output_lines


def _cache_answers(host: Host, cache: CachePull) -> str | None:
    """None when the cache's registry API answers, else why not (one phrase)."""
    # A refused connection is tried again twice, a second apart: a cache (re)started earlier in this run may not
    # be listening yet. No answer at all (curl's exit 28) is not: the host is down or cut off.
    ok, output = host.run_shell_command(
        "for i in 1 2 3; do c=$(curl -s -o /dev/null --noproxy '*' --connect-timeout 3 --max-time 5 "
        f"-w '%{{http_code}}' http://{cache.address}/v2/); r=$?; [ \"$c\" = 200 ] && break; "
        "[ $r = 7 ] && [ $i != 3 ] || break; sleep 1; done; echo \"$c\"", _sudo=False)
    code = (output.stdout or "").strip()
    if ok and code == "200":
        return None
    return f"its registry API answered HTTP {code}" if code not in ("", "000") else "it did not answer"


def _manifest(host: Host, cache: CachePull, digest: str) -> dict[str, Any] | None:
    """The image manifest the cache serves for `digest` (checked against it), an image index followed to the
    host's platform; None when unreadable."""
    arch = snapshot(host).arch or "amd64"  # dpkg's names are the registries' (amd64, arm64)
    for _ in range(2):  # an index, then its platform's manifest
        url = f"http://{cache.address}/v2/{cache.path}/manifests/{digest}"
        ok, output = host.run_shell_command(
            f"curl -fsS --noproxy '*' --max-time 20 -H {shlex.quote('Accept: ' + pull_facts.ACCEPT)} "
            f"{shlex.quote(url)}", _sudo=False)
        if not ok:
            return None
        doc = pull_facts.verified_manifest(output.stdout.encode(), digest)
        if doc is None or not pull_facts.is_index(doc):
            return doc
        found = pull_facts.platform_manifest(doc, arch)
        if found is None:
            return None
        digest = found
    return None


FETCHED = "@@gpufleet:fetched "  # the warm-up's line for each blob it had the cache fetch from upstream


def _warm(host: Host, cache: CachePull, digest: str) -> set[str]:
    """On the cache host, before its own pull: have the cache store every blob of the image, fetched from upstream
    once. distribution's proxy answers a blob it lacks by fetching it twice at once (one stream to the client, one
    into its storage): a request cut after its first byte leaves only the fetch into storage (plus what was in
    flight, a few MB), and the host, which sees the cache's storage, waits for each blob to land there. A blob that
    does not land in time is pulled through the cache as usual. Returns the short ids (as docker pull prints them)
    of the blobs it had the cache fetch from upstream: what this site downloaded for this image."""
    manifest = _manifest(host, cache, digest)
    if manifest is None:
        return set()
    blobs = [d for d in [(manifest.get("config") or {}).get("digest"),
                         *((layer or {}).get("digest") for layer in manifest.get("layers") or ())]
             if isinstance(d, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", d)]
    if not blobs:
        return set()
    # A layer this host's docker holds already (it pulled it from a registry: docker maps the blob's digest to its
    # layer) is not fetched: the last nightly's base layers stay out of the cache until a host without them asks.
    root = shlex.quote(str((snapshot(host).daemon_json or {}).get("data-root") or "/var/lib/docker"))
    held = {d: f"{root}/image/*/distribution/diffid-by-digest/sha256/{d[7:]}" for d in blobs}
    files = {d: f"{STORAGE}/docker/registry/v2/blobs/sha256/{d[7:9]}/{d[7:]}/data" for d in blobs}
    base = f"http://{cache.address}/v2/{cache.path}/blobs/"
    start = "; ".join(f"[ -f {files[d]} ] || ls {held[d]} >/dev/null 2>&1 || {{ w=\"$w {files[d]}\"; "
                      f"echo {shlex.quote(FETCHED + d)}; "
                      f"curl -s --noproxy '*' --max-time 30 {shlex.quote(base + d)} | head -c 1 >/dev/null; }}"
                      for d in blobs)
    wait = "for f in $w; do [ -f $f ] || exit 1; done"
    deadline = max(1, int(cache.timeout_s))
    # Given up after the deadline, or once the storage stops growing for WARM_STALL_S (an upstream that failed
    # the cache's fetch: the pull below then says why).
    _, output = host.run_shell_command(
        f"w=; {start}; end=$(( $(date +%s) + {deadline} )); last=; still=0; until ( {wait} ); do "
        "[ $(date +%s) -lt $end ] || exit 1; "
        f"now=$(du -s {STORAGE} 2>/dev/null | cut -f1); if [ \"$now\" = \"$last\" ]; then "
        f"still=$((still + 1)); [ $still -lt {WARM_STALL_S} ] || exit 1; else still=0; last=$now; fi; sleep 1; done",
        _sudo=use_sudo(host))
    return {line[len(FETCHED) + 7:][:12] for line in output.stdout_lines if line.startswith(FETCHED + "sha256:")}


def _through_cache(host: Host, cache: CachePull, digest: str
                   ) -> tuple[str, set[str] | None, str | None, set[str]]:
    """Pull `digest` from the site cache: ("ok", layers fetched, None, ...) or ("fallback", None, the warning line
    naming why, ...); last, the layers the cache fetched from upstream for it (known on the cache host: its
    warm-up)."""
    where = f"the site cache {cache.address} ({cache.cache_host})"
    why = _cache_answers(host, cache)
    if why is not None:
        return ("fallback", None, f"{host.name}: warning: {where} is not reachable ({why}): pulling from upstream",
                set())
    fetched = _warm(host, cache, digest) if cache.on_this_host else set()
    ok, lines = run_bounded(host, f"docker pull {shlex.quote(cache.ref(digest))}", cache.timeout_s)
    if ok:
        return "ok", pull_facts.downloaded(lines), None, fetched
    text = "\n".join(lines)
    bad = pull_facts.tampered(text)
    if bad:
        # The cache served bytes that do not hash to what was asked (docker installed none of them): corruption,
        # tampering, or whoever answers at its address. The digest comes from upstream; the line names the refusal.
        return "fallback", None, (f"{host.name}: warning: {where} served content that does not match {digest[:19]} "
                                  f"({one_line(bad)}): docker refused it; pulling from upstream (fix: on "
                                  f"{cache.cache_host}, delete the bad blob from {STORAGE}/docker/registry/v2/blobs "
                                  "(or the whole directory: it is a cache) and restart docker-registry)"), fetched
    if lines and lines[-1].strip() == TIMED_OUT:
        why = f"it took over site_cache_pull_timeout_s = {cache.timeout_s:g} s"
    else:
        why = one_line(" | ".join(lines[-2:])) or "no output"
    return ("fallback", None, f"{host.name}: warning: pulling through {where} failed ({why}): pulling from upstream",
            fetched)


def _pull(state: State, host: Host, image: str, pull: str, service: str | None = None,
          cache: CachePull | None = None, timeout_s: float | None = None) -> bool:
    sudo = use_sudo(host)
    digest = pull.rpartition("@")[2] if "@sha256:" in pull else None
    from_cache: set[str] = set()
    fetched: set[str] = set()  # layers the site cache fetched from upstream for this pull (on the cache host)
    fell_back, warning, used = False, None, None
    if cache is not None and digest is not None:
        # Only a digest known before the pull goes through the cache: a tag would be resolved by the cache (a
        # different moment's answer than upstream's), and the unit must run what upstream names.
        outcome, layers, line, fetched = _through_cache(host, cache, digest)
        if outcome == "fallback":
            fell_back, warning = True, line
            host.log_styled(line or "", fg="yellow", log_func=logger.warning)
        else:
            from_cache, used = layers or set(), cache.address
    # The upstream pull records the RepoDigest under the upstream name (the unit runs that); after the cache's pull
    # every layer is present and the image is known by its config, so upstream serves the manifest only.
    ok, lines = run_bounded(host, f"docker pull {shlex.quote(pull)}", timeout_s)
    if used and cache is not None and digest is not None:
        # Only the cache-named reference goes (the layers stay, named by the upstream reference): docker lists
        # and runs the image under the name the unit pins, and nothing on the host names the cache.
        host.run_shell_command(f"docker rmi {shlex.quote(cache.ref(digest))} >/dev/null 2>&1 || true", _sudo=sudo)
    if not ok and lines and lines[-1].strip() == TIMED_OUT:
        return fail(host, f"{host.name}: docker pull {pull} did not finish within vllm_fetch_timeout_s = "
                          f"{timeout_s:g} s and was ended (fix: check that {host.name} reaches the registry; a "
                          "slow line needs a larger vllm_fetch_timeout_s)")
    if not ok:
        return fail(host, f"docker pull {pull} failed: {' | '.join(lines[-3:])}")
    ok, output = host.run_shell_command(
        f"docker image inspect --format '{{{{json .RepoDigests}}}}' {shlex.quote(pull)}", _sudo=sudo)
    ref = pick_digest(pull, json.loads(output.stdout or "[]")) if ok else None
    if not ref:
        return fail(host, f"{image} has no registry digest after the pull (fix: pull it from a registry, "
                          "or set vllm_image to repo@sha256:<digest>)")
    host_run(host).resolved_image_ref = ref  # for the unit, the flag check and the model download
    host.log_styled(f"pinned {image} -> {ref}")
    if service is not None:
        manifest = _manifest(host, cache, ref.rpartition("@")[2]) if cache is not None and not fell_back else None
        sizes = pull_facts.layer_sizes(manifest) if manifest is not None else None
        # What the cache had to fetch from upstream for this host (its warm-up) came from upstream, not the site.
        from_site, via_cache = from_cache - fetched, from_cache & fetched
        stats = PullStats(ref=ref, site_bytes=pull_facts.pulled_bytes(from_site, sizes) if used else 0,
                          upstream_bytes=pull_facts.pulled_bytes(pull_facts.downloaded(lines) | via_cache, sizes),
                          fell_back=fell_back, cache=used, warning=warning)
        # A record, not a decision: a failed write costs the report its bytes, never the pull.
        write_file(host, pull_stats_file(service), stats.to_json())
    return True


def target_ref(pin: str | None, host: Host | None = None) -> str | None:
    """The digest ref the unit must run: resolved by pinned() while executing (this run's state), else `pin`, the
    one known before the pull (pinned_ref: gpufleet_image_ref, or the ledger's pin for this image setting)."""
    return host_run(host).resolved_image_ref or pin


@operation()
def pinned(image: str, ref: str | None, service: str | None = None, cache: CachePull | None = None,
           timeout_s: float | None = None) -> Commands:
    """Pull the image (by `ref`, the digest this run installs, when known) and resolve its tag to a digest.

    cache: the site cache to pull `ref` through first (gpufleet.sitecache.operations); service: whose pull record
    (pull_stats_file) the pull writes; timeout_s: the most the pull from the registry may take."""
    if ref and image_present(snapshot().images, ref):
        host.noop(f"{image} is pinned to {ref.rsplit('@', 1)[1][:19]} and present")
        return
    # A known digest whose image is missing is pulled by digest: the pin does not move.
    yield FunctionCommand(_pull, (image, ref or image), {"service": service, "cache": cache, "timeout_s": timeout_s})
