"""The model: one sha (commit) of its repo, every file checked against the hub's hashes before vLLM sees it.

The design is in docs/deploy.md (step 11) and docs/site-cache.md (the mirror).
"""

from __future__ import annotations

import shlex

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.errors import one_line
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import write_file
from gpufleet.operations.run import host_run
from gpufleet.remote.ssh import use_sudo
from gpufleet.sitecache.operations import ModelMirror
from gpufleet.vllm import weights
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.image import TIMED_OUT, run_bounded, target_ref
from gpufleet.vllm.snapshot import snapshot
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.weights import HubRevision, ModelTarget

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def managed(layout: Layout) -> Managed:
    # The model's files are hf's to write; the deploy owns only the directories.
    return Managed(dirs=(layout.models_dir, layout.hf_cache))


def target_model(model: ModelTarget | None, host: Host | None = None) -> str | None:
    """The repo@sha the unit names: the one this run checked, else the one known before it."""
    if model is None:
        return None
    return host_run(host).resolved_model or model.pin


def missing_parts(snap: HostSnapshot) -> list[str]:
    """What keeps the model directory from being servable; [] when complete."""
    files = snap.model_files
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not any(name in files for name in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " / ".join(TOKENIZER_FILES) + ")")
    weight_files = {name: size for name, size in files.items() if name.endswith(".safetensors")}
    if not weight_files:
        missing.append("weights (*.safetensors)")
    absent = [s for s in snap.model_shards if weight_files.get(s, 0) == 0]
    if absent:
        missing.append(
            f"{len(absent)} of {len(snap.model_shards)} shards listed in model.safetensors.index.json "
            f"(e.g. {absent[0]})"
        )
    empty = [name for name, size in weight_files.items() if size == 0]
    if empty:
        missing.append(f"non-empty weights ({empty[0]} is 0 bytes)")
    if snap.model_incomplete:
        missing.append("an unfinished download (" + snap.model_incomplete[0] + ")")
    return missing


def _warn(host: Host, line: str) -> None:
    host.log_styled(line, fg="yellow", log_func=logger.warning)


def _hub_revision(host: Host, hub: str, model: ModelTarget, env_file: str | None) -> HubRevision | str:
    """The revision's files and hashes as the hub itself lists them, or why not."""
    url = weights.info_url(hub, model.repo, model.ask())
    ok, output = host.run_shell_command(weights.fetch_info_command(url, env_file), _sudo=use_sudo(host))
    if not ok:
        return one_line(" | ".join(output.stderr_lines[-2:])) or "no answer"
    try:
        return weights.parse_info(model.repo, output.stdout)
    except ValueError as error:
        return str(error)


def _mismatches(host: Host, where: str, revision: HubRevision) -> list[str]:
    _, output = host.run_shell_command(weights.hash_command(where, revision.files), _sudo=use_sudo(host))
    return weights.mismatches(revision, output.stdout_lines)


def _mirror_answers(host: Host, mirror: ModelMirror, revision: HubRevision) -> str | None:
    """None when the mirror serves the repo's model info, else why not."""
    url = weights.info_url(mirror.endpoint, revision.repo, revision.sha)
    ok, output = host.run_shell_command(
        f"curl -s -o /dev/null --noproxy '*' --connect-timeout 3 --max-time 30 -w '%{{http_code}}' {shlex.quote(url)}",
        _sudo=False,
    )
    code = (output.stdout or "").strip()
    if ok and code == "200":
        return None
    return f"it answered HTTP {code}" if code not in ("", "000") else "it did not answer"


def _download(
    host: Host,
    spec: ServeSpec,
    image: str,
    revision: HubRevision,
    *,
    endpoint: str,
    env_file: str | None,
    hf_cache: str,
    where: str,
    refused: list[str],
    timeout_s: float | None = None,
) -> str | None:
    """Download the model sha: None on success, TIMED_OUT, or the CLI's last lines.

    Refused files go first: hf skips what it recorded as complete."""
    sudo = use_sudo(host)
    if refused:
        host.run_shell_command(
            "rm -f " + " ".join(shlex.quote(p) for p in weights.partial_paths(where, refused)), _sudo=sudo
        )
    argv = spec.hf_download_argv(
        image, revision.repo, revision.sha, hf_cache, env_file, env=weights.env_for_download(endpoint)
    )
    # docker run's signal proxy passes timeout's SIGTERM to the container.
    ok, lines = run_bounded(host, " ".join(shlex.quote(a) for a in argv), timeout_s)
    if not ok and lines and lines[-1].strip() == TIMED_OUT:
        return TIMED_OUT
    return None if ok else " | ".join(lines[-3:]) or "no output"


def _timed_out(host: Host, repo: str, timeout_s: float | None) -> bool:
    return fail(
        host,
        f"{host.name}: the model download of {repo} did not finish within vllm_fetch_timeout_s = "
        f"{timeout_s or 0:g} s and was ended (fix: check that {host.name} reaches the hub; re-running "
        "resumes, and a slow line needs a larger vllm_fetch_timeout_s)",
    )


def _fetch(
    state: State,
    host: Host,
    spec: ServeSpec,
    model: ModelTarget,
    *,
    where: str,
    env_file: str | None,
    hf_cache: str,
    pin: str | None,
    hub: str,
    mirror: ModelMirror | None,
    timeout_s: float | None = None,
) -> bool:
    revision = _hub_revision(host, hub, model, env_file)
    if isinstance(revision, str):
        return fail(
            host,
            f"cannot read {model.repo} at {model.ask() or 'its default branch'} from the hub {hub} "
            f"({revision}) (fix: check vllm_model_repo, vllm_model_revision and vllm_hf_token, and that "
            "the host reaches vllm_hf_endpoint)",
        )
    sudo = use_sudo(host)
    marker = shlex.quote(f"{where}/{weights.MARKER}")
    snap = snapshot(host)
    if snap.model_checked == revision.pinned and not missing_parts(snap):
        # Checked at this commit by an earlier run.
        host_run(host).resolved_model = revision.pinned
        return True
    # A commit kept aside by a rollout's prepare comes back without a download.
    _, output = host.run_shell_command(weights.restore_command(where, revision.pinned), _sudo=sudo)
    restored = weights.RESTORED in output.stdout_lines
    bad = _mismatches(host, where, revision)
    if bad:
        if not restored and snap.model_checked not in (None, revision.pinned):
            # Another commit moves in: the one here is kept for a rollback.
            ok, output = host.run_shell_command(weights.keep_command(where), _sudo=sudo)
            if not ok:
                return fail(
                    host,
                    f"could not keep {snap.model_checked} beside {where} before downloading another "
                    f"commit: {one_line(' | '.join(output.stderr_lines[-2:]))} (fix: check free space "
                    "and permissions there)",
                )
        host.run_shell_command(f"rm -f {marker}", _sudo=sudo)  # no longer vouched for
        image = target_ref(pin, host) or spec.image
        endpoint = hub
        if mirror is not None:
            why = _mirror_answers(host, mirror, revision)
            if why is None:
                endpoint = mirror.endpoint
            else:
                _warn(
                    host,
                    f"{host.name}: warning: the site cache's model mirror {mirror.endpoint} "
                    f"({mirror.cache_host}) is not reachable ({why}): downloading from the hub {hub}",
                )
        failed = _download(
            host,
            spec,
            image,
            revision,
            endpoint=endpoint,
            env_file=env_file,
            hf_cache=hf_cache,
            where=where,
            refused=bad,
            timeout_s=timeout_s,
        )
        if failed == TIMED_OUT:
            return _timed_out(host, model.repo, timeout_s)
        bad = _mismatches(host, where, revision) if failed is None else bad
        if failed is not None or bad:
            # Never served: fetched again from the hub itself, once.
            source = "the site cache's model mirror" if endpoint != hub else "the hub"
            _warn(
                host,
                f"{host.name}: warning: {source} {endpoint} "
                + (
                    f"served {len(bad)} file(s) whose hash is not the hub's ({', '.join(bad[:3])}): refused"
                    if failed is None
                    else f"download failed ({one_line(failed)})"
                )
                + f"; fetching from the hub {hub}",
            )
            failed = _download(
                host,
                spec,
                image,
                revision,
                endpoint=hub,
                env_file=env_file,
                hf_cache=hf_cache,
                where=where,
                refused=bad,
                timeout_s=timeout_s,
            )
            if failed == TIMED_OUT:
                return _timed_out(host, model.repo, timeout_s)
            bad = _mismatches(host, where, revision) if failed is None else bad
        if failed is not None:
            return fail(
                host,
                f"model download of {model.repo}@{revision.sha[:12]} failed: {failed} (fix: check "
                "vllm_model_repo / vllm_hf_token; re-running resumes)",
            )
        if bad:
            host.run_shell_command(
                "rm -f " + " ".join(shlex.quote(p) for p in weights.partial_paths(where, bad)), _sudo=sudo
            )
            return fail(
                host,
                f"{len(bad)} file(s) of {model.repo}@{revision.sha[:12]} do not match the hub's "
                f"hashes even from the hub ({', '.join(bad[:3])}): deleted, not served (fix: check the "
                "disk under vllm_models_dir, then run again)",
            )
    if not write_file(host, f"{where}/{weights.MARKER}", weights.marker_text(revision)):
        return fail(host, f"could not write {where}/{weights.MARKER} (fix: check free space there)")
    host_run(host).resolved_model = revision.pinned
    host.log_styled(f"model {revision.pinned}: {len(revision.files)} file(s) match the hub's hashes")
    return True


@operation()
def present(
    spec: ServeSpec,
    *,
    where: str,
    model: ModelTarget | None,
    env_file: str | None,
    hf_cache: str,
    pin: str | None,
    hub: str = weights.HUB,
    mirror: ModelMirror | None = None,
    timeout_s: float | None = None,
) -> Commands:
    """The model's sha in `where`, every file checked against the hub's hashes; with no repo, staged by hand.

    env_file is the root-only file holding HF_TOKEN: the token is never an argument."""
    snap = snapshot()
    missing = missing_parts(snap)
    if model is None:
        if missing:
            # Preflight refuses this; kept so the operation is safe on its own.
            raise ValueError(f"{where} lacks {missing[0]} and vllm_model_repo is None")
        count = sum(1 for name in snap.model_files if name.endswith(".safetensors"))
        host.noop(f"{where} is complete (config, tokenizer, {count} weight file(s)), staged by hand")
        return
    if not missing and model.pin is not None and snap.model_checked == model.pin:
        host.noop(f"{where} holds {model.pin[: len(model.repo) + 13]}, checked against the hub's hashes")
        return
    yield FunctionCommand(
        _fetch,
        (spec, model),
        {
            "where": where,
            "env_file": env_file,
            "hf_cache": hf_cache,
            "pin": pin,
            "hub": hub,
            "mirror": mirror,
            "timeout_s": timeout_s,
        },
    )
