"""Replica groups offline: the golden renders of a 2-host PP=2 and a 3-host PP=3 group, the checks across a group's
hosts (one line per problem, naming the host, the setting and the fix), the group's version, and the unit's watch
run on a shell with stand-ins for `ss`, `docker` and `sleep`."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.health import HealthState
from gpufleet.health.runner import HostTarget, check_host
from gpufleet.inventory import load_roles_and_groups
from gpufleet.remote.transport import ContainerInfo
from gpufleet.vllm.group_specs import resolve_hosts
from gpufleet.vllm.unit import WATCH_GRACE_S, watch_argv
from tests.conftest import FIXTURES
from tests.unit import test_cli_render
from tests.unit.systemd_words import split_exec
from tests.unit.test_cli_render import run
from tests.unit.test_spec import sh_argv

GOLDEN = FIXTURES / "groups"
inventory = test_cli_render.inventory  # the fixture: inventory(hosts, group_all) -> path of a fresh inventory


def render(path: str, *args: str) -> str:
    result = run("render", path, *args)
    assert result.exit_code == 0, result.output
    return result.output


def blocks(output: str) -> dict[str, str]:
    """`gpufleet render`'s output per host."""
    return {block.split("\n", 1)[0]: block.split("\n", 1)[1] for block in output.split("# host: ")[1:]}


def resolved(path: str | Path):
    routers, vllm_hosts, orders = load_roles_and_groups(path)
    return resolve_hosts(vllm_hosts, orders, bool(routers))


# --- golden renders --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pp2-2hosts", "pp3-3hosts"])
def test_the_group_renders_equal_the_golden_files_byte_for_byte(name):
    inv = str(GOLDEN / f"{name}.py")
    assert render(inv) == (GOLDEN / f"{name}.docker-run.sh").read_text()
    assert render(inv, "--unit") == (GOLDEN / f"{name}.service").read_text()


@pytest.mark.parametrize(("name", "hosts", "addresses", "port"), [
    ("pp2-2hosts", ["box-a", "box-b"], ["192.168.1.60", "192.168.1.61"], "29501"),
    ("pp3-3hosts", ["box-a", "box-b", "box-c"], ["10.10.0.1", "10.10.0.2", "10.10.0.3"], "29600"),
])  # fmt: skip
def test_the_head_serves_and_every_other_rank_runs_headless_with_its_rank(name, hosts, addresses, port):
    argv = {host: sh_argv(line) for host, line in blocks(render(str(GOLDEN / f"{name}.py"))).items()}
    assert list(argv) == hosts
    for rank, host in enumerate(hosts):
        a = argv[host]
        flags = a[a.index("vllm/vllm-openai:nightly") + 1 :]
        assert flags[flags.index("--nnodes") + 1] == str(len(hosts))
        assert flags[flags.index("--node-rank") + 1] == str(rank)
        assert flags[flags.index("--master-addr") + 1] == addresses[0]
        assert flags[flags.index("--master-port") + 1] == port
        assert flags[flags.index("--pipeline-parallel-size") + 1] == str(len(hosts))
        assert flags[flags.index("--distributed-executor-backend") + 1] == "mp"
        assert ("--headless" in flags) == (rank > 0)
        # Host networking: the ranks meet on ports vLLM picks at start, so nothing is published.
        assert "--network=host" in a and "-p" not in a
        assert f"VLLM_HOST_IP={addresses[rank]}" in a
    if "box-c" in argv:  # its own NIC
        assert "NCCL_SOCKET_IFNAME=eno2" in argv["box-c"] and "NCCL_SOCKET_IFNAME=enp65s0" in argv["box-a"]


def test_each_unit_runs_its_rank_and_watches_its_peers():
    units = blocks(render(str(GOLDEN / "pp3-3hosts.py"), "--unit"))
    for host, peers in {"box-a": "10.10.0.2 10.10.0.3", "box-b": "10.10.0.1", "box-c": "10.10.0.1"}.items():
        lines = units[host].splitlines()
        post = split_exec(next(line for line in lines if line.startswith("ExecStartPost=")).split("=", 1)[1])
        assert post[:2] == ["/bin/sh", "-c"] and post[2].startswith(f"p='{peers}'" if " " in peers else f"p={peers};")
        assert "sport = :29600 or dport = :29600" in post[2]
    assert "# Group trio: rank 2 of 3; the head box-a serves the API." in units["box-c"]


def test_a_replica_of_its_own_renders_no_group_part(inventory):
    out = render(inventory('boxes = [("gpu-box-1", {})]\n'), "--unit")
    assert "ExecStartPost" not in out and "# Group" not in out and "--nnodes" not in out
    assert out == (FIXTURES / "profiles" / "qwen35.service").read_text()


# --- the checks across a group's hosts ----------------------------------------------------------------------------------
TWO = """
pair = ([("a", {{"ssh_hostname": "10.0.0.1"{a}}}), ("b", {{"ssh_hostname": "10.0.0.2"{b}}})],
        {{"vllm_group": "pair", "vllm_profile": "qwen35-1gpu", "vllm_args": {{"pipeline-parallel-size": 2}}{group}}})
"""


def refused(inventory, a: str = "", b: str = "", group: str = "", extra: str = "") -> list[str]:
    result = run("render", inventory(TWO.format(a=a, b=b, group=group) + extra))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return [line.removeprefix("Error: ") for line in result.output.strip().splitlines()]


@pytest.mark.parametrize(("a", "b", "group", "line"), [
    ("", ', "vllm_args": {"pipeline-parallel-size": 2, "max-num-seqs": 8}', "",
     "b: vllm_args: {'pipeline-parallel-size': 2, 'max-num-seqs': 8} differs from the head a's: every rank of group "
     "pair runs one engine (fix: set it in the group's data, so every rank has the same)"),
    ("", ', "vllm_model_revision": "abc123"', "",
     "b: vllm_model_revision: 'abc123' differs from the head a's"),
    ("", ', "vllm_gpus": [0, 1]', "",
     "b: vllm_gpus: lists 2 GPU(s), the head a 1: every rank holds the same share of the model (fix: list 1 GPU(s) "
     "on every rank)"),
    ("", ', "vllm_group": None', "",
     "b: vllm_group: is None, but the host is in group pair, whose other hosts serve one model together (fix: set "
     'vllm_group = "pair" in the group\'s data, not per host)'),
    ("", ', "ssh_hostname": "box-b.lan"', "",
     "b: vllm_group_address: is None and ssh_hostname is not an IP address (fix: set the host's IP address on the "
     'group\'s network, e.g. "10.0.0.12")'),
    ("", ', "vllm_group_address": "10.0.0.1"', "",
     "b: vllm_group_address: 10.0.0.1 is another rank's address too (fix: give each rank its own address"),
    ("", "", ', "vllm_group_port": 5000',
     "a: vllm_group_port: 5000 is not a free TCP port beside vllm_port"),
    ("", ', "vllm_group_interface": "eth0; rm -rf /"', "",
     "b: vllm_group_interface: 'eth0; rm -rf /' is not an interface name"),
    ("", ', "vllm_publish_address": "127.0.0.1"', "",
     "b: vllm_publish_address: a group's ranks run with host networking: nothing is published"),
    ("", "", ', "vllm_args": {"pipeline-parallel-size": 3}',
     "a: vllm_gpus: 2 hosts x 1 GPU(s) but tensor-parallel-size 1 x pipeline-parallel-size 3 = 3 (fix: set vllm_args "
     "pipeline-parallel-size to 2)"),
    ("", "", ', "vllm_gpus": [0, 1], "vllm_args": {"tensor-parallel-size": 4, "pipeline-parallel-size": 1}',
     "a: vllm_args['tensor-parallel-size']: 4 does not divide the 2 GPU(s) of each host: tensor parallel would span "
     "hosts, every layer's all-reduce crossing the network (fix: set tensor-parallel-size to 2 and "
     "pipeline-parallel-size to 2)"),
    ("", "", ', "vllm_args": {"pipeline-parallel-size": 2, "nnodes": 4}',
     "a: vllm_args['nnodes']: group pair sets --nnodes on each rank (fix: remove it; set vllm_group instead)"),
    ("", "", ', "vllm_env": {"VLLM_HOST_IP": "10.0.0.9"}',
     "a: vllm_env['VLLM_HOST_IP']: group pair sets VLLM_HOST_IP on each rank (fix: remove it; set vllm_group_address "
     "instead)"),
    ("", "", ', "vllm_docker_options": {"network": "bridge"}',
     "a: vllm_docker_options['network']: group pair's ranks run with host networking"),
])  # fmt: skip
def test_a_group_problem_is_one_line_naming_the_host_the_setting_and_the_fix(inventory, a, b, group, line):
    lines = refused(inventory, a, b, group)
    assert any(found.startswith(line) for found in lines), lines


def test_a_group_of_one_host_and_a_group_that_is_no_inventory_group_are_refused(inventory):
    one = 'solo = ([("a", {"ssh_hostname": "10.0.0.1"})], {"vllm_group": "solo"})\n'
    result = run("render", inventory(one))
    assert result.output.strip() == (
        "Error: a: vllm_group: group solo has one host (fix: list at least two hosts in "
        "the group, or remove vllm_group)"
    )
    stray = 'boxes = [("a", {"vllm_group": "big"})]\n'
    result = run("render", inventory(stray))
    assert result.output.strip() == (
        "Error: a: vllm_group: 'big' is no inventory group holding this host (fix: set "
        "vllm_group in the data of the group whose hosts serve one model together, to "
        "that group's name)"
    )


def test_a_valid_group_is_resolved_with_every_ranks_spec_hash():
    found, errors = resolved(GOLDEN / "pp3-3hosts.py")
    assert errors == []
    hashes = tuple(found[h][0].spec_hash for h in ("box-a", "box-b", "box-c"))
    assert len(set(hashes)) == 3 and all(found[h][0].group.spec_hashes == hashes for h in found)


def test_the_group_version_is_one_for_every_rank_and_moves_with_the_digest_and_any_ranks_spec():
    found, _ = resolved(GOLDEN / "pp2-2hosts.py")
    head, rank = found["box-a"][0].group, found["box-b"][0].group
    ref, other = "r/v@sha256:" + "1" * 64, "r/v@sha256:" + "2" * 64
    assert head.version(ref) == rank.version(ref) and head.version(ref).startswith("pair@")
    assert head.version(ref) != head.version(other)
    moved = type(head)(**{**head.__dict__, "spec_hashes": (head.spec_hashes[0], "f" * 16)})
    assert moved.version(ref) != head.version(ref)
    # The model's commit is part of it: another commit of the model is another version of the group.
    model = "Qwen/Qwen3.5-35B-A3B-FP8@" + "c" * 40
    assert head.version(ref, model) == rank.version(ref, model) != head.version(ref, model[:-1] + "d")
    assert head.version(ref, model) != head.version(ref)


# --- status of a headless rank ---------------------------------------------------------------------------------------
class RankHost:
    """A headless rank's host as the checks reach it: its container only (it serves no API)."""

    name = "box-b"

    def __init__(self, container: ContainerInfo):
        self._container = container

    def container(self, service: str) -> ContainerInfo | None:
        return self._container

    def http(self, *args, **kwargs):
        raise AssertionError("a headless rank serves no API: nothing asks it")


def test_a_headless_rank_is_its_container_held_to_its_spec_and_to_the_digest_its_ledger_committed():
    found, _ = resolved(GOLDEN / "pp2-2hosts.py")
    spec, data = found["box-b"]
    target = replace(HostTarget.for_spec(spec, data), rank=("pair", 1, "box-a"))
    committed, other = "r/v@sha256:" + "1" * 64, "r/v@sha256:" + "2" * 64
    runs = ContainerInfo("c1", "running", image=committed, spec_hash=spec.spec_hash)
    result = check_host(target, transport=RankHost(runs), committed=lambda t, tr: (committed, None))
    assert result.ok and result.health.detail == (
        "rank 1 of group pair: its container runs; the group serves through box-a"
    )
    moved = check_host(
        target, transport=RankHost(replace(runs, image=other)), committed=lambda t, tr: (committed, None)
    )
    assert moved.health.ready and not moved.ok
    assert moved.committed_drift == f"runs {other}, not {committed}, which its ledger has committed"
    drifted = check_host(target, transport=RankHost(replace(runs, spec_hash="f" * 16)))
    assert drifted.health.state is HealthState.MISCONFIGURED and "drift" in drifted.health.detail


# --- the unit's watch, run on a shell -------------------------------------------------------------------------------
def watch(tmp_path: Path, connections: list[str], rounds: int) -> tuple[str, list[str]]:
    """Run the 2-host group head's watch with `ss` printing connections[i] at its i-th look (the last one after),
    `sleep` returning at once for `rounds` looks, and `docker` recording its calls. (stdout, docker calls)"""
    found, _ = resolved(GOLDEN / "pp2-2hosts.py")
    argv = watch_argv(found["box-a"][0])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "looks").write_text("\n".join(connections) + "\n")
    scripts = {
        "ss": 'n=$(cat "$W/n" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$W/n"; '
        'line=$(sed -n "${n}p" "$W/looks"); [ -n "$line" ] || line=$(tail -n 1 "$W/looks"); '
        'printf "%s\\n" "$line" | tr "|" "\\n"',
        "sleep": 'r=$(cat "$W/r" 2>/dev/null || echo 0); r=$((r + 1)); echo $r > "$W/r"; [ $r -le $ROUNDS ]',
        "docker": 'echo "$*" >> "$W/docker"; [ "$1" = ps ] && echo c0ffee; true',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "W": str(tmp_path), "ROUNDS": str(rounds)}
    script = argv[2].removesuffix("&")  # in the foreground here: the unit leaves it running
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60).stdout
    calls = (tmp_path / "docker").read_text().splitlines() if (tmp_path / "docker").exists() else []
    return out, calls


JOINED = "0 0 [::ffff:192.168.1.60]:29501 [::ffff:192.168.1.61]:41234"  # the rank's store connection, dual-stack


@pytest.mark.skipif(not shutil.which("sed"), reason="needs sed")
def test_the_watch_stops_its_rank_once_a_peer_that_joined_is_gone_for_the_grace(tmp_path):
    out, calls = watch(tmp_path, [JOINED, JOINED, ""], rounds=50)
    assert "gpufleet group watch: 192.168.1.61 left group pair: stopping this rank" in out
    assert calls == ["ps -q --filter label=gpufleet.vllm-qwen35-1gpu", "kill c0ffee"]
    looks = int((tmp_path / "n").read_text())
    assert looks == 2 + WATCH_GRACE_S // 2  # joined twice, then gone for the grace: stopped at once, no later


def test_the_watch_waits_for_its_peers_to_join_and_forgives_a_short_gap(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    # Never joined (a group still starting): nothing stopped however long it looks.
    assert watch(tmp_path / "a", [""], rounds=40)[1] == []
    # Gone for less than the grace, then back (an IPv4 peer as a plain socket shows it): nothing stopped.
    plain = "0 0 192.168.1.60:29501 192.168.1.61:41234"
    assert watch(tmp_path / "b", [JOINED, "", "", plain], rounds=40)[1] == []
