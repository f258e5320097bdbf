"""The serving image, pulled and its tag resolved once to the digest the unit runs (docs/deploy.md)."""

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
    """The digest this run installs for `image`, when known before any pull."""
    if image_ref_setting:
        return image_ref_setting
    ref = parse(image)
    if ref is not None and ref.pinned:
        # "repo:tag@sha256:..." runs, and is listed by docker, as "repo@sha256:...".
        return ref.pinned
    return pin(ledger or Ledger(), image)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pick_digest(image: str, repo_digests: list[str]) -> str | None:
    """The RepoDigests entry of image's repository."""
    repo = repository(image)
    return next((d for d in repo_digests if repository(d.split("@", 1)[0]) == repo), None)


def image_present(images: list[tuple[str, str, str]], ref: str) -> bool:
    """Is `repo@sha256:...` among `docker images --digests` rows, Hub names normalised?"""
    repo, _, digest = ref.partition("@")
    repo = repository(repo)
    return bool(digest) and any(d == digest and repository(r) == repo for r, _, d in images)


def pull_stats_file(service: str) -> str:
    """Not *.json: the snapshot reads those as ledgers."""
    return f"{STATE_DIR}/{service}.pull"


TIMED_OUT = "@@gpufleet:timed-out"
WARM_STALL_S = 60


def run_bounded(host: Host, command: str, timeout_s: float | None = None) -> tuple[bool, list[str]]:
    """A command's success and output lines; ended past timeout_s, its last line is TIMED_OUT."""
    if timeout_s:
        command = (
            f"timeout -k 10 {max(1, int(timeout_s))} {command} || {{ rc=$?; [ $rc -ne 124 ] || "
            f"echo {TIMED_OUT}; exit $rc; }}"
        )
    ok, output = host.run_shell_command(command, _sudo=use_sudo(host), print_output=True)
    return bool(ok), output.output_lines


def _cache_answers(host: Host, cache: CachePull) -> str | None:
    """None when the cache's registry API answers, else why not."""
    # Retry a refused connection only: a cache restarted in this run may not listen yet.
    ok, output = host.run_shell_command(
        "for i in 1 2 3; do c=$(curl -s -o /dev/null --noproxy '*' --connect-timeout 3 --max-time 5 "
        f"-w '%{{http_code}}' http://{cache.address}/v2/); r=$?; [ \"$c\" = 200 ] && break; "
        '[ $r = 7 ] && [ $i != 3 ] || break; sleep 1; done; echo "$c"',
        _sudo=False,
    )
    code = (output.stdout or "").strip()
    if ok and code == "200":
        return None
    return f"its registry API answered HTTP {code}" if code not in ("", "000") else "it did not answer"


def _manifest(host: Host, cache: CachePull, digest: str) -> dict[str, Any] | None:
    """The verified manifest for `digest`, an index followed to the host's platform."""
    arch = snapshot(host).arch or "amd64"
    for _ in range(2):  # an index, then its platform's manifest
        url = f"http://{cache.address}/v2/{cache.path}/manifests/{digest}"
        ok, output = host.run_shell_command(
            f"curl -fsS --noproxy '*' --max-time 20 -H {shlex.quote('Accept: ' + pull_facts.ACCEPT)} "
            f"{shlex.quote(url)}",
            _sudo=False,
        )
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


FETCHED = "@@gpufleet:fetched "


def _warm(host: Host, cache: CachePull, digest: str) -> set[str]:
    """The cache host's warm-up (docs/site-cache.md): the short ids of the blobs the cache fetched from upstream."""
    manifest = _manifest(host, cache, digest)
    if manifest is None:
        return set()
    blobs = [
        d
        for d in [
            (manifest.get("config") or {}).get("digest"),
            *((layer or {}).get("digest") for layer in manifest.get("layers") or ()),
        ]
        if isinstance(d, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", d)
    ]
    if not blobs:
        return set()
    # Layers this host holds are skipped: old base layers stay out of the cache.
    root = shlex.quote(str((snapshot(host).daemon_json or {}).get("data-root") or "/var/lib/docker"))
    held = {d: f"{root}/image/*/distribution/diffid-by-digest/sha256/{d[7:]}" for d in blobs}
    files = {d: f"{STORAGE}/docker/registry/v2/blobs/sha256/{d[7:9]}/{d[7:]}/data" for d in blobs}
    base = f"http://{cache.address}/v2/{cache.path}/blobs/"
    start = "; ".join(
        f'[ -f {files[d]} ] || ls {held[d]} >/dev/null 2>&1 || {{ w="$w {files[d]}"; '
        f"echo {shlex.quote(FETCHED + d)}; "
        f"curl -s --noproxy '*' --max-time 30 {shlex.quote(base + d)} | head -c 1 >/dev/null; }}"
        for d in blobs
    )
    wait = "for f in $w; do [ -f $f ] || exit 1; done"
    deadline = max(1, int(cache.timeout_s))
    # A stalled storage means upstream failed; the pull below says why.
    _, output = host.run_shell_command(
        f"w=; {start}; end=$(( $(date +%s) + {deadline} )); last=; still=0; until ( {wait} ); do "
        "[ $(date +%s) -lt $end ] || exit 1; "
        f'now=$(du -s {STORAGE} 2>/dev/null | cut -f1); if [ "$now" = "$last" ]; then '
        f"still=$((still + 1)); [ $still -lt {WARM_STALL_S} ] || exit 1; else still=0; last=$now; fi; sleep 1; done",
        _sudo=use_sudo(host),
    )
    return {line[len(FETCHED) + 7 :][:12] for line in output.stdout_lines if line.startswith(FETCHED + "sha256:")}


def _through_cache(host: Host, cache: CachePull, digest: str) -> tuple[str, set[str] | None, str | None, set[str]]:
    """Pull `digest` through the site cache: ("ok", layers, None, fetched) or ("fallback", None, warning, fetched)."""
    where = f"the site cache {cache.address} ({cache.cache_host})"
    why = _cache_answers(host, cache)
    if why is not None:
        return (
            "fallback",
            None,
            f"{host.name}: warning: {where} is not reachable ({why}): pulling from upstream",
            set(),
        )
    fetched = _warm(host, cache, digest) if cache.on_this_host else set()
    ok, lines = run_bounded(host, f"docker pull {shlex.quote(cache.ref(digest))}", cache.timeout_s)
    if ok:
        return "ok", pull_facts.downloaded(lines), None, fetched
    text = "\n".join(lines)
    bad = pull_facts.tampered(text)
    if bad:
        return (
            "fallback",
            None,
            (
                f"{host.name}: warning: {where} served content that does not match {digest[:19]} "
                f"({one_line(bad)}): docker refused it; pulling from upstream (fix: on "
                f"{cache.cache_host}, delete the bad blob from {STORAGE}/docker/registry/v2/blobs "
                "(or the whole directory: it is a cache) and restart docker-registry)"
            ),
            fetched,
        )
    if lines and lines[-1].strip() == TIMED_OUT:
        why = f"it took over site_cache_pull_timeout_s = {cache.timeout_s:g} s"
    else:
        why = one_line(" | ".join(lines[-2:])) or "no output"
    return (
        "fallback",
        None,
        f"{host.name}: warning: pulling through {where} failed ({why}): pulling from upstream",
        fetched,
    )


def _pull(
    state: State,
    host: Host,
    image: str,
    pull: str,
    service: str | None = None,
    cache: CachePull | None = None,
    timeout_s: float | None = None,
) -> bool:
    sudo = use_sudo(host)
    digest = pull.rpartition("@")[2] if "@sha256:" in pull else None
    from_cache: set[str] = set()
    fetched: set[str] = set()
    fell_back, warning, used = False, None, None
    if cache is not None and digest is not None:
        # A tag is resolved upstream: the unit runs what upstream names it.
        outcome, layers, line, fetched = _through_cache(host, cache, digest)
        if outcome == "fallback":
            fell_back, warning = True, line
            host.log_styled(line or "", fg="yellow", log_func=logger.warning)
        else:
            from_cache, used = layers or set(), cache.address
    ok, lines = run_bounded(host, f"docker pull {shlex.quote(pull)}", timeout_s)
    if used and cache is not None and digest is not None:
        host.run_shell_command(f"docker rmi {shlex.quote(cache.ref(digest))} >/dev/null 2>&1 || true", _sudo=sudo)
    if not ok and lines and lines[-1].strip() == TIMED_OUT:
        return fail(
            host,
            f"{host.name}: docker pull {pull} did not finish within vllm_fetch_timeout_s = "
            f"{timeout_s:g} s and was ended (fix: check that {host.name} reaches the registry; a "
            "slow line needs a larger vllm_fetch_timeout_s)",
        )
    if not ok:
        return fail(host, f"docker pull {pull} failed: {' | '.join(lines[-3:])}")
    ok, output = host.run_shell_command(
        f"docker image inspect --format '{{{{json .RepoDigests}}}}' {shlex.quote(pull)}", _sudo=sudo
    )
    ref = pick_digest(pull, json.loads(output.stdout or "[]")) if ok else None
    if not ref:
        return fail(
            host,
            f"{image} has no registry digest after the pull (fix: pull it from a registry, "
            "or set vllm_image to repo@sha256:<digest>)",
        )
    host_run(host).resolved_ref = ref
    host.log_styled(f"pinned {image} -> {ref}")
    if service is not None:
        manifest = _manifest(host, cache, ref.rpartition("@")[2]) if cache is not None and not fell_back else None
        sizes = pull_facts.layer_sizes(manifest) if manifest is not None else None
        from_site, via_cache = from_cache - fetched, from_cache & fetched
        stats = PullStats(
            ref=ref,
            site_bytes=pull_facts.pulled_bytes(from_site, sizes) if used else 0,
            upstream_bytes=pull_facts.pulled_bytes(pull_facts.downloaded(lines) | via_cache, sizes),
            fell_back=fell_back,
            cache=used,
            warning=warning,
        )
        # A record: a failed write never fails the pull.
        write_file(host, pull_stats_file(service), stats.to_json())
    return True


def target_ref(pin: str | None, host: Host | None = None) -> str | None:
    """The digest the unit must run: the one pinned() resolved in this run, else `pin`."""
    return host_run(host).resolved_ref or pin


@operation()
def pinned(
    image: str,
    ref: str | None,
    service: str | None = None,
    cache: CachePull | None = None,
    timeout_s: float | None = None,
) -> Commands:
    """Pull the image, by `ref` when known, and resolve its tag to a digest."""
    if ref and image_present(snapshot().images, ref):
        host.noop(f"{image} is pinned to {ref.rsplit('@', 1)[1][:19]} and present")
        return
    yield FunctionCommand(_pull, (image, ref or image), {"service": service, "cache": cache, "timeout_s": timeout_s})
