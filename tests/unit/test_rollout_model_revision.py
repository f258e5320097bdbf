"""`gpufleet rollout --model-revision`: the revision resolved to one commit once, on a host, against the stand-in
hub on loopback (the host's command run by this machine's shell), and that commit handed to the prepare and to
every swap of the rollout."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.errors import GpufleetError
from gpufleet.hoststate.ledger import Committed, Ledger, Version, begin, roll_back
from gpufleet.rollout import commands as rollout_commands
from gpufleet.rollout import prepare as rollout_prepare
from gpufleet.rollout import target as rollout_target
from gpufleet.rollout.deploy_run import DeployRun, RunSettings
from gpufleet.rollout.hosts import FleetHost
from gpufleet.rollout.ledgers import HostLedger
from gpufleet.rollout.swap import SwapOptions
from gpufleet.rollout.target import Target, resolve_model
from gpufleet.sandbox import hub as standin
from gpufleet.sandbox.image import MODEL_REPO, write_tiny_model
from gpufleet.vllm.settings import build_spec

REF = "reg:5000/vllm/vllm-openai@sha256:" + "a" * 64


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """(endpoint, hub root, the first commit of main) of a stand-in hub serving the tiny model."""
    model = tmp_path / "tiny"
    write_tiny_model(model)
    root = tmp_path / "hub"
    commit = standin.publish(root, MODEL_REPO, {p.name: p for p in model.iterdir()})
    httpd = standin.server(root, "127.0.0.1", 0, tmp_path / "hub.log")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root, commit
    finally:
        httpd.shutdown()
        httpd.server_close()


def fleet(endpoint: str, n: int = 2) -> list[FleetHost]:
    data = {"vllm_model_repo": MODEL_REPO, "vllm_hf_endpoint": endpoint}
    return [FleetHost(f"h{i}", build_spec(f"h{i}", data), data) for i in range(1, n + 1)]


class Sessions:
    """The hosts' sessions; asked for counts each host the rollout reached."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def get(self, name: str) -> str:
        self.asked.append(name)
        return name


@pytest.fixture
def shell(monkeypatch) -> list[str]:
    """Each host command run by this machine's shell; returns the commands run."""
    commands: list[str] = []

    def run(transport, command, timeout=60.0, root=False):
        commands.append(command)
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr

    monkeypatch.setattr(rollout_target, "shell", run)
    return commands


def test_a_branch_resolves_to_the_commit_it_names_now_from_the_first_host(hub, shell, tmp_path):
    endpoint, root, first = hub
    sessions = Sessions()
    assert resolve_model(fleet(endpoint), sessions, "main") == first
    assert sessions.asked == ["h1"] and len(shell) == 1
    moved = standin.publish(root, MODEL_REPO, {"config.json": b"{}\n"})
    assert moved != first and resolve_model(fleet(endpoint), Sessions(), "main") == moved
    with pytest.raises(GpufleetError, match=rf"^h1: cannot read {MODEL_REPO} at nope from the hub .*\(fix: "):
        resolve_model(fleet(endpoint), Sessions(), "nope")


def test_a_commit_is_taken_as_it_is_and_no_repo_is_refused(hub, shell):
    endpoint, _, _first = hub
    sessions = Sessions()
    assert resolve_model(fleet(endpoint), sessions, "d" * 40) == "d" * 40
    assert sessions.asked == [] and shell == []
    data = {"vllm_model_repo": None}
    with pytest.raises(GpufleetError, match="vllm_model_repo is None"):
        resolve_model([FleetHost("h1", build_spec("h1", data), data)], sessions, "main")


def test_the_rollout_resolves_once_and_every_run_installs_that_commit(hub, shell, monkeypatch, tmp_path):
    endpoint, _, first = hub
    hosts = fleet(endpoint, 3)
    resolved: list[str] = []
    handed: list[SwapOptions] = []

    def resolve_once(hosts, sessions, revision):
        resolved.append(revision)
        return resolve_model(hosts, sessions, revision)

    def roll(ctx, confirm):
        handed.append(ctx.options)
        return rollout_commands.Result(ctx.what, [])

    monkeypatch.setattr(rollout_commands, "load_fleet", lambda inventory: hosts)
    monkeypatch.setattr(rollout_commands, "Sessions", lambda hosts: nullcontext(Sessions()))
    monkeypatch.setattr(rollout_commands, "resolve", lambda hosts, sessions, image: Target(REF, ""))
    monkeypatch.setattr(rollout_commands, "resolve_model", resolve_once)
    monkeypatch.setattr(rollout_commands, "_roll", roll)
    progress = type("P", (), {"note": lambda self, line: None})()
    options = SwapOptions(tmp_path / "deploy.py")
    rollout_commands.roll_out(
        "inv.py", None, options, lambda *a: True, lambda names: nullcontext(progress), model_revision="main"
    )
    assert resolved == ["main"] and [o.model_sha for o in handed] == [first]
    # What the swaps and the prepare of that rollout hand each deploy run.
    (swap_options,) = handed
    assert swap_options.run_settings(REF).model_sha == first
    assert swap_options.run_settings(REF, committed={"h1": None}, canary=True).model_sha == first
    seen: list[RunSettings] = []

    def run_deploy(inventory, hosts, settings, deploy_file, log=None, timeout_s=None):
        seen.append(settings)
        return DeployRun(tuple(hosts), 0, "", 0.1)

    monkeypatch.setattr(rollout_prepare, "run_deploy", run_deploy)
    monkeypatch.setattr(rollout_prepare, "pull_order", lambda inventory, names: [names[:1], names[1:]])
    rollout_prepare.prepare(
        "inv.py", [h.name for h in hosts], REF, tmp_path / "deploy.py", model_sha=swap_options.model_sha
    )
    assert [s.model_sha for s in seen] == [first, first] and all(s.stage == "prepare" for s in seen)
    # Without --model-revision nothing is asked of the hub and no run names a model commit.
    handed.clear()
    rollout_commands.roll_out("inv.py", None, options, lambda *a: True, lambda names: nullcontext(progress))
    assert resolved == ["main"] and [o.model_sha for o in handed] == [None]


def test_a_failed_model_move_refuses_that_commit_again_not_the_version_rolled_back_to():
    """The same digest and settings with a new commit failed its gate: a rollout of that digest that keeps the
    committed model (or moves to another commit) goes on; the failed commit again needs --retry-failed."""
    old, bad = f"{MODEL_REPO}@{'0' * 40}", f"{MODEL_REPO}@{'1' * 40}"
    committed = Version(
        image="reg:5000/vllm/vllm-openai:good",
        ref=REF,
        unit_sha256="a" * 64,
        spec_hash="0123456789abcdef",
        service="vllm-qwen35",
        port=5000,
        model=old,
    )
    ledger = roll_back(
        begin(Ledger(committed=Committed(committed, "t0")), replace(committed, model=bad), "ops", "t1"),
        "never ready",
        "t2",
    )
    ledgers, targets = {"h1": HostLedger("h1", "/var/lib/gpufleet/vllm-qwen35.json", ledger)}, {"h1": REF}
    assert rollout_commands._refused(ledgers, targets, None) is None
    assert rollout_commands._refused(ledgers, targets, "2" * 40) is None
    refusal = rollout_commands._refused(ledgers, targets, "1" * 40)
    assert refusal is not None and refusal.startswith(f"h1: {REF} failed there at t2: never ready (fix: ")
