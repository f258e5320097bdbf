"""The compile-cache carry (gpufleet.rollout.carry and its carry_entries, carry_eligibility, carry_stream and
warm_start): which entries, who takes them (GPUs read from nvidia-smi output recorded on real hosts), what is
refused; the stream and the placement over real SSH channels to a throwaway sshd (two cache dirs on this machine
stand for two hosts)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet.facts.nvidia import QUERY_GPUS
from gpufleet.remote.transport import SshTransport
from gpufleet.rollout.carry import Carry, CarryResult
from gpufleet.rollout.carry_eligibility import (
    Gpus,
    compile_hash_refusal,
    config_refusal,
    gpu_refusal,
    gpus_from_query,
)
from gpufleet.rollout.carry_entries import Listed, carried_dir, entries, new_files, parse_listing, placements
from gpufleet.rollout.carry_stream import receive_command, relay, stream_problem, temp_dir
from gpufleet.rollout.compile_factors import MARK, CompileFactors, factors_command, parse_factors
from gpufleet.rollout.warm_start import start_report
from gpufleet.vllm.spec import Mount

SHA = "a" * 64
NVIDIA_SMI = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"


def recorded_query(kind: str) -> str:
    """QUERY_GPUS's stdout as recorded on a real host (tests/fixtures/nvidia-smi/<kind>/README.md)."""
    return (NVIDIA_SMI / kind / "query-gpu.csv").read_text()


def read_gpus(out: str) -> Gpus:
    gpus = gpus_from_query(0, out, "")
    assert isinstance(gpus, Gpus), gpus
    return gpus


H200 = read_gpus(recorded_query("h200-2gpu"))  # 2x NVIDIA H200, driver 580.159.04
H100 = read_gpus(recorded_query("h200-2gpu").replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))


def factors(version: str = "0.24.0", **values: str) -> CompileFactors:
    """What the compile-factor script prints for these factor digests, parsed."""
    digests = {"VLLM_USE_DEEP_GEMM": "5feceb66ffc86f38", "VLLM_API_KEY": "0b2f1a9c6e11d3aa"} | values
    env = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()  # follows the values, as vLLM's
    line = MARK + json.dumps({"vllm": version, "env": env, "factors": digests})
    parsed = parse_factors(0, "INFO a warning vLLM printed first\n" + line + "\n")
    assert isinstance(parsed, CompileFactors), parsed
    return parsed


# --- decisions -----------------------------------------------------------------------------------------------------
def listing(*items: tuple[str, str, float]) -> str:
    """find's answer (listing_command) for (type letter, path, change time) items."""
    return "".join(f"{kind} {changed:.10f} {path}\0" for kind, path, changed in items)


def test_the_new_versions_entries_are_the_files_new_since_the_canarys_swap():
    before = parse_listing(
        listing(
            ("d", "torch_compile_cache", 1.0),
            ("d", "torch_compile_cache/torch_aot_compile", 1.0),
            ("d", "torch_compile_cache/torch_aot_compile/old", 1.0),
            ("f", "torch_compile_cache/torch_aot_compile/old/m", 1.0),
            ("f", "modelinfos/x.json", 1.0),
        )
    )
    after = {
        **before,
        **parse_listing(
            listing(
                ("d", "torch_compile_cache/torch_aot_compile/new", 20.0),
                ("d", "torch_compile_cache/torch_aot_compile/new/rank_0_0", 20.0),
                ("f", "torch_compile_cache/torch_aot_compile/new/rank_0_0/model", 20.0),
                ("f", "torch_compile_cache/torch_aot_compile/new/inductor_cache/ab/c.so", 21.0),
                ("l", "torch_compile_cache/torch_aot_compile/new/link", 21.0),  # never carried: regular files only
                ("f", "torch_compile_cache/torch_aot_compile/late/x", 9.0),  # the old container's, after the listing
                ("f", "modelinfos/x.json", 20.0),
            )
        ),
    }  # rewritten in place: not new, not carried
    files = new_files(before, after, since=10.0)  # the new container started at 10
    assert files == [
        "torch_compile_cache/torch_aot_compile/new/inductor_cache/ab/c.so",
        "torch_compile_cache/torch_aot_compile/new/rank_0_0/model",
    ]
    assert entries(before, files) == ["torch_compile_cache/torch_aot_compile/new"]
    # A listing naming a path outside the directory (a canary that lies) names nothing.
    assert parse_listing(listing(("f", "../etc/cron.d/x", 20.0), ("f", "a//b", 20.0), ("f", "./c", 20.0))) == {}


def test_a_host_takes_only_the_entries_it_lacks_entirely_never_a_part_of_one():
    files = ["modelinfos/y.json", "tc/aot/new/inductor_cache/c.so", "tc/aot/new/rank_0_0/model"]
    new = ["modelinfos/y.json", "tc/aot/new"]
    old_version = {p: Listed("d", 1.0) for p in ("tc", "tc/aot", "tc/aot/old", "modelinfos")}
    # a host whose old version compiled too: the new hash dir goes in whole, in one rename
    assert placements(new, files, old_version) == (["modelinfos/y.json", "tc/aot/new"], [])
    # a host that has part of the entry (an earlier start of the new version): left as it is
    partial = {
        **old_version,
        "tc/aot/new": Listed("d", 5.0),
        "tc/aot/new/rank_0_0": Listed("d", 5.0),
        "tc/aot/new/rank_0_0/model": Listed("f", 5.0),
    }
    assert placements(new, files, partial) == (["modelinfos/y.json"], ["tc/aot/new"])
    # the whole of it (a re-run): nothing, and nothing partial
    whole = {
        **partial,
        "tc/aot/new/inductor_cache": Listed("d", 5.0),
        "tc/aot/new/inductor_cache/c.so": Listed("f", 5.0),
    }
    assert placements(new, files, whole) == (["modelinfos/y.json"], [])
    assert placements(new, files, {}) == (new, [])
    # a canary whose cache was empty before: its entry is the whole tree; a host with an older tree there takes,
    # per file, the shallowest path it lacks
    assert placements(["modelinfos", "tc"], files, old_version) == (["modelinfos/y.json", "tc/aot/new"], [])
    assert placements(["modelinfos", "tc"], files, partial) == (["modelinfos/y.json"], ["tc"])


def test_only_the_vllm_cache_mount_is_carried():
    spec = SimpleNamespace(
        mounts=(
            Mount("/models", "/models"),
            Mount("/var/cache/vllm/q/torch", "/root/.cache/torch"),
            Mount("/var/cache/vllm/q/vllm/", "/root/.cache/vllm"),
        )
    )
    assert carried_dir(spec) == "/var/cache/vllm/q/vllm"  # type: ignore[arg-type]
    assert carried_dir(SimpleNamespace(mounts=(Mount("/m", "/models"),))) is None  # type: ignore[arg-type]


class RecordedHost:
    """A host whose nvidia-smi answers the preflight's GPU query with what a real host printed."""

    def __init__(self, rc: int, out: str, err: str = "") -> None:
        self.answer = (rc, out, err)

    def shell(self, command: str, timeout: float) -> tuple[int, str, str]:
        assert command == f"timeout -k 2 20 {QUERY_GPUS}"  # a hung driver does not hold the host's shell
        return self.answer


def gpus_of(rc: int, out: str, err: str = "") -> Gpus | str:
    carry = Carry(SimpleNamespace(get=lambda name: RecordedHost(rc, out, err)), {})  # type: ignore[arg-type]
    return carry._gpus_of("h")


def test_each_hosts_gpus_are_read_with_the_preflights_query_and_parser():
    assert gpus_of(0, recorded_query("h200-2gpu")) == Gpus(("NVIDIA H200",) * 2, "580.159.04")
    assert gpus_of(0, recorded_query("h200-1gpu")) == Gpus(("NVIDIA H200",), "580.159.04")
    bad_field = (NVIDIA_SMI / "h200-2gpu" / "bad-field.txt").read_text().split("\nrc=")[0]
    assert gpus_of(2, bad_field) == 'nvidia-smi failed: Field "bogus" is not a valid field to query.'
    assert gpus_of(127, "", "sh: nvidia-smi: not found") == "nvidia-smi failed: sh: nvidia-smi: not found"
    other_driver = recorded_query("h200-2gpu").replace("580.159.04", "535.104.05", 1)
    assert gpus_of(0, other_driver) == "GPUs report different drivers: 535.104.05, 580.159.04"
    assert gpus_of(0, "NVIDIA H200, 580.159.04\n").startswith("nvidia-smi --query-gpu line 1: expected 14 ")
    assert gpus_of(124, "") == "nvidia-smi did not answer within 20 s"


def test_gpus_and_driver_must_match_the_canarys():
    assert gpu_refusal("c", H200, H200) is None
    assert gpu_refusal("c", H200, H100) == (
        "its GPUs (2x NVIDIA H100 80GB HBM3, driver 580.159.04) differ from canary c's (2x NVIDIA H200, driver "
        "580.159.04)"
    )
    assert "differ" in (gpu_refusal("c", H200, read_gpus(recorded_query("h200-1gpu"))) or "")
    assert "driver 535.104.05" in (
        gpu_refusal("c", H200, read_gpus(recorded_query("h200-2gpu").replace("580.159.04", "535.104.05"))) or ""
    )
    assert gpu_refusal("c", H200, "nvidia-smi failed: x") == "its GPUs unknown (nvidia-smi failed: x)"


def test_only_hosts_serving_the_canarys_config_take_its_artifacts():
    def spec(env=(("VLLM_SLEEP_WHEN_IDLE", "1"),), gpus=(0, 1, 2), **args):
        flags = {
            "model": "/models/q",
            "host": "0.0.0.0",
            "port": 5000,
            "served-model-name": "q",
            "pipeline-parallel-size": 3,
            "kv-cache-dtype": "fp8_e4m3",
            **args,
        }
        return SimpleNamespace(vllm_args=tuple(flags.items()), env=env, gpus=gpus)

    canary = spec()
    assert config_refusal("c", canary, spec(port=5001, **{"served-model-name": "other"})) is None  # type: ignore[arg-type]
    assert config_refusal("c", canary, spec(**{"pipeline-parallel-size": 2})) == (  # type: ignore[arg-type]
        "its serve config differs from canary c's (pipeline-parallel-size)"
    )
    assert config_refusal("c", canary, spec(env=(), gpus=(0, 1))) == (  # type: ignore[arg-type]
        "its serve config differs from canary c's (env VLLM_SLEEP_WHEN_IDLE, the number of GPUs it serves on)"
    )
    many = spec(**{"kv-cache-dtype": "auto", "pipeline-parallel-size": 1, "max-num-seqs": 4, "model": "/m/x"})
    assert config_refusal("c", canary, many) == (  # type: ignore[arg-type]
        "its serve config differs from canary c's (kv-cache-dtype, max-num-seqs, model and 1 more)"
    )


def test_the_compile_factors_are_the_images_own_computed_with_the_hosts_env_and_secrets():
    spec = SimpleNamespace(env=(("VLLM_USE_DEEP_GEMM", "0"), ("OMP_NUM_THREADS", "16")))
    command = factors_command(spec, "sha256:abc", "/etc/gpufleet/vllm-qwen35.env")  # type: ignore[arg-type]
    assert command.startswith(
        "set --; [ -f /etc/gpufleet/vllm-qwen35.env ] && set -- --env-file "
        "/etc/gpufleet/vllm-qwen35.env; timeout -k 5 120 docker run --rm --network none "
        '--entrypoint python3 -e VLLM_USE_DEEP_GEMM=0 -e OMP_NUM_THREADS=16 "$@" sha256:abc -c '
    )
    assert "--gpus" not in command and "-p " not in command and "-v " not in command
    assert "envs.compile_factors()" in command and "hash_factors(f)" in command


@pytest.mark.parametrize("has_secrets", [True, False])
def test_the_factors_run_takes_the_secrets_file_only_where_the_host_has_one(tmp_path, has_secrets):
    env_file, docker = tmp_path / "vllm-qwen35.env", tmp_path / "bin" / "docker"
    if has_secrets:
        env_file.write_text("VLLM_API_KEY=sk-x\n")
    docker.parent.mkdir()
    docker.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # prints the argv it was given
    docker.chmod(0o755)
    spec = SimpleNamespace(env=(("OMP_NUM_THREADS", "16"),))
    command = factors_command(spec, "sha256:abc", str(env_file))  # type: ignore[arg-type]
    argv = subprocess.run(
        ["sh", "-c", command],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": f"{docker.parent}:/usr/bin:/bin"},
    ).stdout.splitlines()
    before_image = argv[: argv.index("sha256:abc")]
    assert before_image[-2:] == (["--env-file", str(env_file)] if has_secrets else ["-e", "OMP_NUM_THREADS=16"])


def test_unreadable_factors_are_one_line_never_a_match():
    assert parse_factors(1, "Traceback (most recent call last):\nModuleNotFoundError: No module named 'vllm'\n") == (
        "the image's vLLM did not compute them (exit 1: ModuleNotFoundError: No module named 'vllm')"
    )
    assert parse_factors(0, "") == "the image's vLLM did not compute them (exit 0: exit 0)"
    assert parse_factors(0, MARK + "{not json").startswith("unreadable answer (")
    assert parse_factors(124, "") == "the image's vLLM did not compute them (exit 124: exit 124)"


def test_a_host_takes_the_canarys_entries_only_where_vllm_computes_the_same_compile_hash():
    canary = factors()
    assert compile_hash_refusal("c", canary, factors()) is None
    assert compile_hash_refusal("c", canary, factors(VLLM_API_KEY="77aa00ee11bb22cc")) == (
        "its compile hash differs from canary c's (factors that differ: VLLM_API_KEY)"
    )
    assert compile_hash_refusal("c", canary, factors("0.24.1")) == "its vLLM 0.24.1 is not canary c's 0.24.0"
    assert compile_hash_refusal("c", canary, "the image's vLLM did not compute them (exit 1: x)") == (
        "its compile hash unknown (the image's vLLM did not compute them (exit 1: x))"
    )
    assert compile_hash_refusal("c", "the canary's image is unknown", canary) == (
        "canary c's compile hash unknown (the canary's image is unknown)"
    )


def test_the_stream_is_taken_only_when_both_tars_ended_well_and_three_checksums_agree():
    good = f"tar-rc 0\n{SHA}  -\n"
    assert stream_problem(good, SHA, good) is None
    assert stream_problem(good, SHA, f"tar-rc 0\n{'b' * 64}  -\n") == (
        "checksum mismatch (canary aaaaaaaaaaaa, relayed aaaaaaaaaaaa, host bbbbbbbbbbbb)"
    )
    assert "checksum mismatch" in (stream_problem(good, "c" * 64, good) or "")
    assert stream_problem(f"tar: x: Cannot stat\ntar-rc 2\n{SHA}  -\n", SHA, good) == (
        "tar on the canary failed (tar: x: Cannot stat)"
    )
    assert stream_problem(good, SHA, "mkdir: cannot create directory\n") == (
        "tar on the host failed (mkdir: cannot create directory); a checksum is missing"
    )


def test_a_start_is_warm_when_the_engine_says_it_loaded_its_compiled_artifacts():
    started = 1_700_000_000.0
    warm = [
        "2023-11-14T22:13:20.100000000Z INFO vLLM API server version 0.32.0",
        "2023-11-14T22:13:21.000000000Z (Worker pid=1) INFO [decorators.py:320] [backbone] Directly load AOT "
        "compilation from path /root/.cache/vllm/torch_compile_cache/torch_aot_compile/k/rank_0_0/model",
        "2023-11-14T22:13:22.500000000Z INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)",
    ]
    assert start_report(warm, started) == (True, 2.5)
    cold = [
        warm[0],
        "2023-11-14T22:13:30.000000000Z INFO [decorators.py:743] [backbone] saved AOT compiled function to /x",
        warm[2].replace("22:13:22", "22:13:31"),
    ]
    assert start_report(cold, started) == (False, 11.5)
    assert start_report(["no stamps here"], None) == (None, None)
    # vLLM's piecewise backend (VLLM_USE_AOT_COMPILE=0) says it in its own words
    piecewise = "2023-11-14T22:13:21Z INFO [backends.py:295] [backbone] Directly load the compiled graph(s) for "
    assert start_report([piecewise + "compile range (1, 8192) from the cache, took 1.2 s", warm[2]], started)[0] is True
    assert (
        start_report(
            [
                "2023-11-14T22:13:21Z INFO [backends.py:398] Compiling a graph for compile range (1, 8192) "
                "takes 40.1 s",
                warm[2],
            ],
            started,
        )[0]
        is False
    )


# --- over SSH: two cache dirs on this machine, one sshd ------------------------------------------------------------
@pytest.fixture
def fleet(sshd, tmp_path, monkeypatch):
    """Hosts c (the canary), t and u: each one SSH session to the throwaway sshd, each its own cache dir."""
    transports = {}
    hosts = {}
    for name in ("c", "t", "u", "w"):
        cache = tmp_path / name / "vllm"
        cache.mkdir(parents=True)
        args = (("model", "/models/q"), ("port", 5000 + len(name)), ("pipeline-parallel-size", 2 if name == "w" else 3))
        spec = SimpleNamespace(
            mounts=(Mount(str(cache), "/root/.cache/vllm"),),
            service="vllm-qwen35",
            vllm_args=args,
            env=(("VLLM_SLEEP_WHEN_IDLE", "1"),),
            gpus=(0, 1, 2),
        )
        hosts[name] = SimpleNamespace(name=name, spec=spec, data={})
        transports[name] = SshTransport(sshd.client(), name=name, sudo=False)
    gpus = {"c": H200, "t": H200, "u": H100, "w": H200}
    monkeypatch.setattr(Carry, "_gpus_of", lambda self, host: gpus[host])
    # The image's vLLM computes each host's factors in a container (no image here; tests/vllm shows the real one)
    computed = {name: factors() for name in hosts}
    monkeypatch.setattr(Carry, "_factors_of", lambda self, host: computed[host])
    # The canary's new container started (docker's StartedAt): set by a test that writes the old container's files.
    started = SimpleNamespace(at=0.0)
    monkeypatch.setattr(Carry, "_started", lambda self, host: started.at)
    sessions = SimpleNamespace(get=lambda name: transports[name])
    yield SimpleNamespace(
        sessions=sessions,
        hosts=hosts,
        dir=lambda n: tmp_path / n / "vllm",
        root=tmp_path,
        factors=computed,
        started=started,
        lock=str(tmp_path / "lock"),
    )
    for t in transports.values():
        t.client.close()


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def compiled(cache: Path, key: str, data: bytes) -> list[Path]:
    files = [
        cache / "torch_compile_cache" / "torch_aot_compile" / key / "rank_0_0" / "model",
        cache / "torch_compile_cache" / "torch_aot_compile" / key / "inductor_cache" / "ab" / "c.so",
    ]
    for f in files:
        write(f, data + f.name.encode())
    return files


def new_carry(fleet, lines: list[str], **kw) -> Carry:
    return Carry(fleet.sessions, fleet.hosts, note=lines.append, lock_path=fleet.lock, **kw)  # type: ignore[arg-type]


def test_a_host_takes_the_new_entries_into_its_cache_and_keeps_its_own(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    compiled(canary, "old", b"old version on the canary ")
    compiled(host, "old", b"old version on the host ")
    write(host / "modelinfos" / "x.json", b"the host's own")
    lines: list[str] = []
    carry = new_carry(fleet, lines)
    carry.before_canary("c")
    new = compiled(canary, "new", b"new version " * 5000)  # what the canary's start compiled
    write(canary / "modelinfos" / "x.json", b"the canary's")  # new on the canary, but the host has its own
    carry.after_canary(committed=True)
    assert carry.results["c"].entries == (
        "modelinfos/x.json",
        "torch_compile_cache/torch_aot_compile/new/inductor_cache/ab/c.so",
        "torch_compile_cache/torch_aot_compile/new/rank_0_0/model",
    )
    carry.into(["t"])
    result = carry.results["t"]
    assert result.skipped_reason is None, result
    assert result.entries == ("torch_compile_cache/torch_aot_compile/new",)
    assert result.carried_bytes > 60_000
    for f in new:
        assert (host / f.relative_to(canary)).read_bytes() == f.read_bytes()
    assert (host / "modelinfos" / "x.json").read_bytes() == b"the host's own"  # never overwritten
    assert (host / "torch_compile_cache" / "torch_aot_compile" / "old" / "rank_0_0" / "model").exists()
    assert not list((fleet.root / "t").glob(".*gpufleet-carry*"))  # the temp dir is gone
    # again (a re-run): it has every entry, nothing is streamed
    carry.into(["t"])
    assert carry.results["t"] == CarryResult(skipped_reason="it has every entry already")


def test_a_stream_changed_in_flight_is_refused_and_nothing_is_put_in_place(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    lines: list[str] = []
    carry = new_carry(fleet, lines, tamper=lambda chunk: chunk[:-1] + bytes([chunk[-1] ^ 1]))
    carry.before_canary("c")
    compiled(canary, "new", b"new version " * 100)
    carry.after_canary(committed=True)
    carry.into(["t"])
    reason = carry.results["t"].skipped_reason or ""
    assert reason.startswith("refused: ") and "checksum mismatch" in reason, reason
    assert carry.results["t"].carried_bytes == 0
    assert not list(host.rglob("*"))
    assert not list((fleet.root / "t").glob(".*gpufleet-carry*"))
    assert lines[-1].startswith("t: compile cache not carried: refused: ")


def test_a_host_with_other_gpus_does_not_take_them(fleet):
    canary, other = fleet.dir("c"), fleet.dir("u")
    lines: list[str] = []
    carry = new_carry(fleet, lines)
    carry.before_canary("c")
    compiled(canary, "new", b"x")
    carry.after_canary(committed=True)
    carry.into(["t", "u"])
    assert carry.results["t"].skipped_reason is None
    assert carry.results["u"].skipped_reason == (
        "its GPUs (2x NVIDIA H100 80GB HBM3, driver 580.159.04) differ "
        "from canary c's (2x NVIDIA H200, driver 580.159.04)"
    )
    assert not list(other.rglob("*"))
    assert [ln for ln in lines if ln.startswith("u: ")] == [
        f"u: compile cache not carried: {carry.results['u'].skipped_reason}"
    ]


def test_a_host_on_which_vllm_computes_another_compile_hash_does_not_take_them(fleet):
    fleet.factors["t"] = factors(VLLM_API_KEY="77aa00ee11bb22cc")  # vLLM 0.24 hashes the API key
    lines: list[str] = []
    carry = new_carry(fleet, lines)
    carry.before_canary("c")
    compiled(fleet.dir("c"), "new", b"x")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert carry.results["t"].skipped_reason == (
        "its compile hash differs from canary c's (factors that differ: VLLM_API_KEY)"
    )
    assert lines[-1] == f"t: compile cache not carried: {carry.results['t'].skipped_reason}"
    assert not list(fleet.dir("t").rglob("*"))


def test_a_host_with_another_serve_config_does_not_take_them(fleet):
    carry = new_carry(fleet, [])
    carry.before_canary("c")
    compiled(fleet.dir("c"), "new", b"x")
    carry.after_canary(committed=True)
    carry.into(["w"])
    assert carry.results["w"].skipped_reason == ("its serve config differs from canary c's (pipeline-parallel-size)")
    assert not list(fleet.dir("w").rglob("*"))


@pytest.mark.parametrize(
    ("committed", "turned_off"),
    [
        pytest.param(False, None, id="the-canary-was-not-committed"),
        pytest.param(True, "the carry is turned off (--no-carry)", id="the-carry-is-turned-off"),
    ],
)
def test_a_carry_that_does_not_run_carries_nothing_and_says_why(fleet, committed, turned_off):
    carry = new_carry(fleet, [], turned_off=turned_off)
    carry.before_canary("c")
    compiled(fleet.dir("c"), "new", b"x")
    carry.after_canary(committed=committed)
    carry.into(["t"])
    assert carry.results["t"].carried_bytes == 0
    reason = carry.results["t"].skipped_reason or ""
    # Turned off: the reason it was given, word for word; a canary not committed: says so.
    assert (reason == turned_off) if turned_off else ("was not committed" in reason), reason
    assert not list(fleet.dir("t").rglob("*"))


def test_nothing_new_on_the_canary_is_said_once_and_nothing_is_streamed(fleet):
    lines: list[str] = []
    carry = new_carry(fleet, lines)
    carry.before_canary("c")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert carry.results["t"].skipped_reason == f"canary c wrote no new entry in {fleet.dir('c')}"


def test_relay_hashes_what_it_relays(sshd, tmp_path):
    a, b = SshTransport(sshd.client(), "a", sudo=False), SshTransport(sshd.client(), "b", sudo=False)
    try:
        total, sha, sent, received = relay(
            a, "{ head -c 300000 /dev/urandom | tee /dev/fd/3 | sha256sum >&2; } 3>&1", b"", b, "sha256sum >&2"
        )
    finally:
        a.client.close()
        b.client.close()
    assert total == 300000
    assert sent.split()[0] == sha == received.split()[0]


# --- where the swap calls it ---------------------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def before_canary(self, host):
        self.calls.append(("before_canary", host))

    def after_canary(self, committed):
        self.calls.append(("after_canary", committed))

    def into(self, group):
        self.calls.append(("into", list(group)))

    def observe(self, group):
        self.calls.append(("observe", list(group)))


def swapped(monkeypatch, canary_outcome, canary: int = 1):
    from gpufleet.rollout import swap as swap_mod
    from gpufleet.rollout.context import RolloutContext
    from gpufleet.rollout.report import HostOutcome, Outcome
    from gpufleet.rollout.routers import Routers

    def fake_batch(ctx, batch, target_ref, *, before, role):
        return {
            h: HostOutcome(h, "old", target_ref, canary_outcome if role == "canary" else Outcome.UPDATED, 1.0)
            for h in batch
        }

    monkeypatch.setattr(swap_mod, "_swap_batch", fake_batch)
    recorder = Recorder()
    order = ["h1", "h2", "h3", "h4"]
    options = swap_mod.SwapOptions(Path("d.py"), canary=canary, batch=2)
    before = {h: SimpleNamespace(committed_ref="old") for h in order}
    ctx = RolloutContext(
        inventory="inv",
        hosts={},
        sessions=None,
        target_refs=dict.fromkeys(order, "new"),  # type: ignore[arg-type]
        what="new",
        options=options,
        progress=SimpleNamespace(phase=lambda *a: None),
    )  # type: ignore[arg-type]
    swap_mod.swap(ctx, order, before=before, routers=Routers([], {}), carry=recorder)  # type: ignore[arg-type]
    return recorder.calls


def test_the_swap_lists_around_the_canary_and_carries_before_each_batch(monkeypatch):
    from gpufleet.rollout.report import Outcome

    assert swapped(monkeypatch, Outcome.UPDATED) == [
        ("before_canary", "h1"),
        ("after_canary", True),
        ("observe", ["h1"]),
        ("into", ["h2", "h3"]),
        ("observe", ["h2", "h3"]),
        ("into", ["h4"]),
        ("observe", ["h4"]),
    ]


def test_a_canary_that_is_rolled_back_stops_the_swap_before_any_carry(monkeypatch):
    from gpufleet.rollout.report import Outcome

    assert swapped(monkeypatch, Outcome.ROLLED_BACK) == [
        ("before_canary", "h1"),
        ("after_canary", False),
        ("observe", []),
    ]


def test_without_a_canary_nothing_is_carried_and_each_start_is_still_read(monkeypatch):
    from gpufleet.rollout.report import Outcome

    assert swapped(monkeypatch, Outcome.UPDATED, canary=0) == [("observe", ["h1", "h2"]), ("observe", ["h3", "h4"])]


@pytest.mark.timeout(60)
def test_relay_streams_while_the_source_still_reads_its_list(sshd):
    # tar writes an archive while it reads its list of names: both must move at once (each beyond the SSH window).
    a, b = SshTransport(sshd.client(), "a", sudo=False), SshTransport(sshd.client(), "b", sudo=False)
    source = "{ { head -c 6000000 /dev/urandom; cat > /dev/null; } | tee /dev/fd/3 | sha256sum >&2; } 3>&1"
    try:
        total, sha, sent, received = relay(a, source, b"n" * 4_000_000, b, "sha256sum >&2")
    finally:
        a.client.close()
        b.client.close()
    assert total == 6_000_000
    assert sent.split()[0] == sha == received.split()[0]


def test_a_hosts_result_as_a_json_row_and_a_table_cell():
    warm = CarryResult(carried_bytes=92160, entries=("a",), warm=True, time_to_ready_s=2.24)
    assert warm.as_dict() == {"warm": True, "time_to_ready_s": 2.24, "carried_bytes": 92160, "carry_skipped": None}
    assert warm.cell() == "warm, 2.2 s (90 KiB carried)"
    assert CarryResult(warm=False, time_to_ready_s=17.24, canary=True).cell() == "cold, 17.2 s (canary)"
    other = CarryResult(skipped_reason="its GPUs (...) differ from canary c's (...)", warm=False, time_to_ready_s=8.4)
    assert other.cell() == "cold, 8.4 s (not carried: its GPUs (...) differ from canary c's (...))"
    assert CarryResult().cell() == "-"


# --- what a malicious nightly or a compromised canary can send: nothing lands outside, nothing keeps its owner -------
def test_carried_files_lose_their_owner_and_setuid_bits(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    carry = new_carry(fleet, [])
    carry.before_canary("c")
    [model, kernel] = compiled(canary, "new", b"new version ")
    kernel.chmod(0o4755)  # a setuid root shell, as far as a later host could tell
    os.chown(kernel, 1234, 1234)
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert carry.results["t"].skipped_reason is None, carry.results["t"]
    got = host / kernel.relative_to(canary)
    assert (got.stat().st_uid, stat.S_IMODE(got.stat().st_mode)) == (os.getuid(), 0o755)
    assert stat.S_IMODE((host / model.relative_to(canary)).stat().st_mode) == 0o644


def crafted_tar(tmp_path: Path, add) -> Path:
    """A tar stream a compromised canary could send, whatever its listing said."""
    path = tmp_path / "crafted.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as t:
        add(t)
    return path


def member(t: tarfile.TarFile, name: str, data: bytes | None = None, **fields) -> None:
    info = tarfile.TarInfo(name)
    for key, value in fields.items():
        setattr(info, key, value)
    if data is not None:
        info.size = len(data)
    t.addfile(info, io.BytesIO(data) if data is not None else None)


@pytest.mark.parametrize(
    "special",
    [
        lambda t: member(t, "e/link", type=tarfile.SYMTYPE, linkname="/etc"),
        lambda t: (member(t, "e/a", b"x"), member(t, "e/hard", type=tarfile.LNKTYPE, linkname="e/a")),
        lambda t: member(t, "e/fifo", type=tarfile.FIFOTYPE),
        lambda t: member(t, "e/mem", type=tarfile.CHRTYPE, devmajor=1, devminor=1),
    ],
    ids=["symlink", "hard-link", "fifo", "device"],
)
def test_a_stream_holding_anything_but_regular_files_and_directories_is_refused_whole(fleet, tmp_path, special):
    stream = crafted_tar(tmp_path, lambda t: (member(t, "e/ok", b"fine"), special(t)))
    tmp = temp_dir(str(fleet.dir("t")))
    _, _relayed, _, received = relay(
        fleet.sessions.get("c"),
        f"cat {stream}",
        b"",
        fleet.sessions.get("t"),
        receive_command(str(fleet.dir("t")), tmp),
    )
    assert "tar-rc 90" in received and "not a regular file or directory: e/" in received, received
    assert not Path(tmp).exists()  # nothing of it is kept to be placed


def test_a_link_planted_in_the_hosts_cache_dir_places_nothing_outside_it(fleet, tmp_path):
    canary, host = fleet.dir("c"), fleet.dir("t")
    outside = tmp_path / "etc-cron.d"  # where a link the old nightly left in its cache dir points on the host
    outside.mkdir()
    (host / "torch_compile_cache").symlink_to(outside)
    lines: list[str] = []
    carry = new_carry(fleet, lines)
    carry.before_canary("c")
    compiled(canary, "new", b"new version ")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert list(outside.rglob("*")) == []
    assert carry.results["t"].carried_bytes == 0
    assert carry.results["t"].skipped_reason == (
        "not placed: torch_compile_cache/torch_aot_compile: torch_compile_cache is not a directory"
    )
    assert not list((fleet.root / "t").glob(".*gpufleet-carry*"))


def test_what_the_old_container_wrote_after_the_first_listing_is_not_carried(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    carry = new_carry(fleet, [])
    carry.before_canary("c")
    compiled(canary, "planted", b"written by the old container before its stop ")
    time.sleep(0.05)
    fleet.started.at = time.time()  # the new container starts
    time.sleep(0.05)
    compiled(canary, "new", b"new version ")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert carry.results["c"].entries == (
        "torch_compile_cache/torch_aot_compile/new/inductor_cache/ab/c.so",
        "torch_compile_cache/torch_aot_compile/new/rank_0_0/model",
    )
    assert (host / "torch_compile_cache" / "torch_aot_compile" / "new" / "rank_0_0" / "model").exists()
    assert not (host / "torch_compile_cache" / "torch_aot_compile" / "planted").exists()


def test_nothing_is_placed_inside_an_entry_an_earlier_start_left_in_part(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    compiled(canary, "old", b"old version ")
    compiled(host, "old", b"old version ")
    carry = new_carry(fleet, [])
    carry.before_canary("c")
    compiled(canary, "new", b"new version ")
    write(host / "torch_compile_cache" / "torch_aot_compile" / "new" / "rank_0_0" / "model", b"half written")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert carry.results["t"].skipped_reason == (
        "it has part of torch_compile_cache/torch_aot_compile/new already (an earlier start's): left as it is"
    )
    assert sorted(p.name for p in (host / "torch_compile_cache" / "torch_aot_compile" / "new").rglob("*")) == [
        "model",
        "rank_0_0",
    ]


def test_the_carry_writes_only_under_the_hosts_lock(fleet):
    from gpufleet.hostlock import Holder, HostLock

    carry = new_carry(fleet, [])
    carry.before_canary("c")
    compiled(fleet.dir("c"), "new", b"new version ")
    carry.after_canary(committed=True)
    other = fleet.sessions.get("u").client  # another run's session, holding t's lock
    with HostLock(other, "t", path=fleet.lock, holder=Holder("alice", "laptop", 4242, "2026-12-02T03:00:00Z")):
        carry.into(["t"])
    assert (carry.results["t"].skipped_reason or "").startswith("its lock: t: locked by alice@laptop pid 4242")
    assert not list(fleet.dir("t").rglob("*"))
    carry.into(["t"])  # free again: taken, and let go after
    assert carry.results["t"].skipped_reason is None
    with HostLock(other, "t", path=fleet.lock):
        pass


def test_a_carry_past_its_time_limit_is_cut_and_leaves_nothing(fleet):
    carry = new_carry(fleet, [], timeout_s=0.0)
    carry.before_canary("c")
    compiled(fleet.dir("c"), "new", b"new version ")
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert "the carry passed its time limit" in (carry.results["t"].skipped_reason or "")
    assert not list(fleet.dir("t").rglob("*")) and not list((fleet.root / "t").glob(".*gpufleet-carry*"))


def test_a_controller_killed_mid_stream_leaves_no_temp_dir_and_the_next_carry_clears_old_ones(fleet):
    canary, host = fleet.dir("c"), fleet.dir("t")
    stale = fleet.root / "t" / ".vllm.gpufleet-carry-0123456789ab"  # what a controller killed earlier left
    stale.mkdir()
    target = fleet.sessions.get("t")

    def cut(chunk: bytes) -> bytes:  # the controller dies mid-stream: its session to the host closes
        target.client.close()
        return chunk

    carry = new_carry(fleet, [], tamper=cut)
    carry.before_canary("c")
    compiled(canary, "new", os.urandom(2_000_000))
    carry.after_canary(committed=True)
    carry.into(["t"])
    assert (carry.results["t"].skipped_reason or "").startswith("carry failed: ")
    deadline = time.monotonic() + 20
    while list((fleet.root / "t").glob(".*gpufleet-carry*")):  # the host's side ends on its own
        assert time.monotonic() < deadline, list((fleet.root / "t").glob(".*"))
        time.sleep(0.1)
    assert not list(host.rglob("*"))
