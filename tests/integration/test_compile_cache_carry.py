"""Only the canary compiles (gpufleet.rollout.carry) on three test hosts: two 3x H200 and one 3x H200 NVL (another
GPU model), the stand-in vLLM compiling for STANDIN_COMPILE_SECONDS when its version's cache entry is absent.

1. converged on the module's tag (= good), then a rollout to good-next (canary 1, batch 2): the canary compiles;
   the other H200 takes the canary's new entry over SSH and starts warm, faster than the canary; the H200 NVL
   does not take it (one line) and compiles its own;
2. the tag on completions-fail: the canary is rolled back and nothing is carried (no host's cache changes).

Its own fleet (gf-carry, 10.213.4.0/24, hosts gfc1..3): it never waits on the session's fleet or `roll`.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gpufleet.rollout.carry_entries import carried_dir
from gpufleet.rollout.commands import roll_out
from gpufleet.rollout.hosts import load_fleet
from gpufleet.rollout.progress import Progress
from gpufleet.rollout.report import Outcome
from gpufleet.rollout.swap import SwapOptions
from gpufleet.sandbox.config import Gpus, H200x3
from gpufleet.sandbox.registry import move_tag
from tests.integration.fleets import module_tag, own_fleet_config, running_fleet, tagged_inventory
from tests.integration.pyinfra_run import run_deploy

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploys" / "qwen35.py"
COMPILE_S = 6  # the stand-in's cold start: well above what two hosts' start times vary by on 2 busy cores
DATA = {"vllm_ready_timeout": 90, "vllm_ready_soak_s": 2, "vllm_env": {"STANDIN_COMPILE_SECONDS": str(COMPILE_S)}}
NVL = Gpus(3, model="NVIDIA H200 NVL")


@pytest.fixture(scope="module")
def fleet():
    with running_fleet(own_fleet_config("carry", "10.213.4", "gfc", "GPUFLEET_CARRY_FLEET_DIR")) as f:
        yield f


@pytest.fixture(scope="module")
def hosts(fleet):
    return fleet.add_hosts([H200x3, H200x3, NVL], first=1)


@pytest.fixture(scope="module")
def tag() -> str:
    return module_tag("carry")


@pytest.fixture(scope="module")
def inventory(hosts, fleet, tag, tmp_path_factory) -> Path:
    return tagged_inventory(tmp_path_factory.mktemp("carry") / "carry_hosts.py", fleet, hosts, tag, DATA)


@pytest.fixture(scope="module")
def cache_dirs(inventory) -> dict[str, str]:
    dirs = {h.name: carried_dir(h.spec) for h in load_fleet(str(inventory))}
    assert all(dirs.values()), dirs
    return dirs  # type: ignore[return-value]


@pytest.fixture(scope="module")
def converged(fleet, tag, inventory, pyinfra, hosts):
    move_tag(fleet.cfg.registry, tag, "good")
    run_deploy(pyinfra, inventory, str(DEPLOY))


def files(fleet, host, directory: str) -> dict[str, str]:
    """{relative path: sha256} of every file under the host's cache dir."""
    out = fleet.run_in(
        host,
        f"cd {shlex.quote(directory)} && find . -type f -printf '%P\\n' | sort | "
        'while read -r f; do printf \'%s %s\\n\' "$(sha256sum < "$f" | cut -c1-64)" "$f"; '
        "done",
    ).stdout
    return {line.split(" ", 1)[1]: line.split(" ", 1)[0] for line in out.splitlines() if " " in line}


def rollout(inventory: Path, notes: list[str]):
    class Quiet(Progress):
        def note(self, text: str) -> None:
            notes.append(text)
            super().note(text)

    options = SwapOptions(deploy_file=DEPLOY, canary=1, batch=2, canary_checks=())
    return roll_out(str(inventory), None, options, lambda *_: True, lambda names: Quiet(names))


def test_the_canary_compiles_the_same_gpus_start_warm_other_gpus_do_not_take_it(
    fleet, tag, inventory, hosts, cache_dirs, converged
):
    canary, same, other = (h.name for h in hosts)
    before = {h.name: files(fleet, h, cache_dirs[h.name]) for h in hosts}
    move_tag(fleet.cfg.registry, tag, "good-next")
    notes: list[str] = []
    result = rollout(inventory, notes)
    print("\n[carry]", dict(result.carried.items()))
    assert [o.outcome for o in result.outcomes] == [Outcome.UPDATED] * 3, result.outcomes
    carried = result.carried

    # The canary compiled the new version (its engine saved the artifact) and wrote new entries.
    assert carried[canary].canary and carried[canary].warm is False and carried[canary].entries
    after = {h.name: files(fleet, h, cache_dirs[h.name]) for h in hosts}
    new_on_canary = {p: s for p, s in after[canary].items() if p not in before[canary]}
    assert set(new_on_canary) == set(carried[canary].entries)

    # The same GPUs: the canary's entries, byte for byte, and a warm start, faster than the canary's.
    assert carried[same].skipped_reason is None and carried[same].carried_bytes > 0, carried[same]
    assert {p: after[same][p] for p in new_on_canary} == new_on_canary
    assert carried[same].warm is True
    assert carried[same].time_to_ready_s is not None and carried[canary].time_to_ready_s is not None
    assert carried[same].time_to_ready_s < carried[canary].time_to_ready_s - COMPILE_S / 2, carried
    # ... and what it had stays as it was.
    assert {p: after[same][p] for p in before[same]} == before[same]

    # Another GPU model: not taken, one line; it compiled its own.
    reason = carried[other].skipped_reason or ""
    assert "differ from canary" in reason and "H200 NVL" in reason, carried[other]
    assert carried[other].carried_bytes == 0 and carried[other].warm is False
    assert [n for n in notes if n.startswith(f"{other}: compile cache not carried")] == [
        f"{other}: compile cache not carried: {reason}"
    ]


def test_a_rollout_whose_canary_fails_carries_nothing(fleet, tag, inventory, hosts, cache_dirs, converged):
    canary, *others = hosts
    before = {h.name: files(fleet, h, cache_dirs[h.name]) for h in others}
    move_tag(fleet.cfg.registry, tag, "completions-fail")
    notes: list[str] = []
    result = rollout(inventory, notes)
    outcomes = {o.host: o.outcome for o in result.outcomes}
    assert outcomes == {canary.name: Outcome.ROLLED_BACK, **{h.name: Outcome.NOT_STARTED for h in others}}
    assert all(r.carried_bytes == 0 for r in result.carried.values()), result.carried
    assert {h.name: files(fleet, h, cache_dirs[h.name]) for h in others} == before
    assert not [n for n in notes if n.startswith("carrying")]
