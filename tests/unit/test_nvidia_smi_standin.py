"""The nvidia-smi stand-in against the real recordings: byte for byte where a real box would print the same."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet.facts.nvidia import QUERY_GPUS, QUERY_VERSION
from gpufleet.sandbox import nvidia_smi as smi

RECORDINGS = Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-smi"
PREFLIGHT_QUERY = (
    "--query-gpu=index,uuid,name,memory.total,memory.used,memory.free,driver_version,pci.bus_id,"
    "compute_cap,persistence_mode,temperature.gpu,utilization.gpu,power.draw,power.limit"
)
# recording file -> the command that produced it (see the recordings' README.md)
COMMANDS = {
    "nvidia-smi-L.txt": ["-L"],
    "version.txt": ["--version"],
    "topo.txt": ["topo", "-m"],
    "count.txt": ["--query-gpu=count", "--format=csv,noheader"],
    "query-gpu.csv": [PREFLIGHT_QUERY, "--format=csv,noheader,nounits"],
    "query-gpu-header.csv": ["--query-gpu=index,uuid,name,memory.total,driver_version,compute_cap", "--format=csv"],
    "bad-field.txt": ["--query-gpu=bogus", "--format=csv"],
    "bad-index.txt": ["-i", "7"],
}


def _dynamic_masked(text: str) -> str:
    """The table's timestamp and live readings (temperature, power) change between any two calls on a real box."""
    text = re.sub(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}", "TIME", text)
    return re.sub(r"\| N/A +\d+C +P0 +\d+W", "| N/A TEMP P0 POWER", text)


@pytest.mark.parametrize("recording", ["h200-1gpu", "h200-2gpu"])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_replays_recording_byte_for_byte(recording: str, name: str) -> None:
    profile = smi.profile_from_recording(RECORDINGS / recording)
    expected, rc = smi._read(RECORDINGS / recording, name)
    assert smi.render(profile, COMMANDS[name]) == smi.Result(expected, rc)


@pytest.mark.parametrize("recording", ["h200-1gpu", "h200-2gpu"])
def test_table_matches_recording_except_live_readings(recording: str) -> None:
    profile = smi.profile_from_recording(RECORDINGS / recording)
    expected = (RECORDINGS / recording / "nvidia-smi.txt").read_text()
    assert _dynamic_masked(smi.render(profile, []).stdout) == _dynamic_masked(expected)


def test_generated_two_gpu_box_has_the_recorded_layout() -> None:
    """make_profile(2) replicates rows of the recording: only the GPU identities differ."""
    made = smi.make_profile(2, seed="gft1")
    real = RECORDINGS / "h200-2gpu"
    uuids = [g.uuid for g in smi.profile_from_recording(real).gpus]
    for name in ("query-gpu.csv", "nvidia-smi-L.txt", "topo.txt", "version.txt"):
        out = smi.render(made, COMMANDS[name]).stdout
        for real_uuid, made_uuid in zip(uuids, (g.uuid for g in made.gpus), strict=False):
            out = out.replace(made_uuid, real_uuid)
        assert out == smi._read(real, name)[0]


def test_three_gpu_box_and_per_host_identities() -> None:
    p = smi.make_profile(3, seed="gpuhost1")
    assert smi.render(p, COMMANDS["count.txt"]).stdout == "3\n3\n3\n"
    rows = smi.render(p, COMMANDS["query-gpu.csv"]).stdout.splitlines()
    assert [r.split(", ")[7] for r in rows] == ["00000000:00:06.0", "00000000:00:07.0", "00000000:00:08.0"]
    assert len({g.uuid for g in p.gpus} | {g.uuid for g in smi.make_profile(3, seed="gpuhost2").gpus}) == 6
    assert smi.render(p, ["-i", "3"]) == smi.Result("No devices were found\n", 6)
    assert "GPU2\tNV18\tNV18\t X \t" in smi.render(p, ["topo", "-m"]).stdout


def test_old_driver_box() -> None:
    p = smi.make_profile(8, driver="535.104.05", cuda="12.2", memory_mib=81559, model="NVIDIA A100-SXM4-80GB")
    assert smi.render(p, ["--version"]).stdout.splitlines()[-1] == "CUDA Version        : 12.2"
    table = smi.render(p, []).stdout
    assert "Driver Version: 535.104.05     CUDA Version: 12.2     |" in table
    assert table.count("NVIDIA A100-SXM4-80GB") == 8
    assert all(len(line) == 91 for line in table.splitlines()[1:] if line)
    assert "81559, 0, 80944, 535.104.05" in smi.render(p, COMMANDS["query-gpu.csv"]).stdout


@pytest.mark.parametrize("argv", [["--bogus"], ["topo"], ["-q", "--nonsense"]])
def test_unknown_arguments_exit_2(argv: list[str]) -> None:
    assert smi.render(smi.make_profile(1), argv).rc == 2


def _host_argv(root: Path, *args: str) -> list[str]:
    """The installed wrapper's command line under root, with this interpreter for the host's /usr/bin/python3."""
    wrapper = shlex.split((root / "usr/bin/nvidia-smi").read_text().splitlines()[-1])  # exec python3 FLAGS... "$@"
    return [sys.executable, *(str(root / a[1:]) if a.startswith("/") else a for a in wrapper[2:-1]), *args]


def test_host_files_run_as_nvidia_smi(tmp_path: Path) -> None:
    """What a host runs: the installed wrapper's profile, through this file as a script (stdlib only)."""
    smi.write_host_files(tmp_path, smi.make_profile(2, seed="h"))
    out = subprocess.run(_host_argv(tmp_path, "--query-gpu=bogus", "--format=csv"), capture_output=True, text=True)
    assert (out.stdout, out.returncode) == smi._read(RECORDINGS / "h200-2gpu", "bad-field.txt")
    assert "/usr/bin/python3" in (tmp_path / "usr/bin/nvidia-smi").read_text()


def _imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("command", [QUERY_GPUS, QUERY_VERSION])
def test_host_answers_a_converge_query_without_heavy_imports(tmp_path: Path, command: str) -> None:
    """The real tool answers in ~20 ms; the stand-in's share of that is an interpreter start plus builtins."""
    profile = smi.make_profile(2, seed="h")
    smi.write_host_files(tmp_path, profile)
    args = shlex.split(command)[1:]
    python, *flags, module, prof = _host_argv(tmp_path)
    out = subprocess.run([python, *flags, "-X", "importtime", module, prof, *args], capture_output=True, text=True)
    assert (out.stdout, out.returncode) == (smi.render(profile, args).stdout, 0)
    bare = subprocess.run([python, *flags, "-X", "importtime", "-c", "pass"], capture_output=True, text=True)
    assert _imported(out.stderr) - _imported(bare.stderr) <= {"__future__", "_json", "time"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_host_rows_render_like_the_profile(name: str) -> None:
    """The host half reads the profile as plain rows: every answer is the same as from the dataclasses."""
    profile = smi.make_profile(3, seed="h", driver="535.104.05", cuda="12.2")
    assert smi.render(smi.host_profile(profile.to_json()), COMMANDS[name]) == smi.render(profile, COMMANDS[name])


def test_host_rows_have_the_dataclass_fields_and_defaults() -> None:
    full = json.loads(smi.make_profile(2).to_json())
    defaults = {
        f.name
        for f in dataclasses.fields(smi.Profile)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    gpu_defaults = {f.name for f in dataclasses.fields(smi.Gpu) if f.default is not dataclasses.MISSING}
    bare = {k: v for k, v in full.items() if k not in defaults}
    bare["gpus"] = [{k: v for k, v in g.items() if k not in gpu_defaults} for g in full["gpus"]]
    rows = smi.host_profile(json.dumps(bare))
    expected = smi.Profile.from_json(json.dumps(bare))
    assert {k: v for k, v in vars(rows).items() if k != "gpus"} == {
        k: v for k, v in dataclasses.asdict(expected).items() if k != "gpus"
    }
    assert [vars(g) for g in rows.gpus] == [dataclasses.asdict(g) for g in expected.gpus]


@pytest.mark.parametrize("text", ["", " {", '{"gpus": []} x', "\ufeff{}", "{'gpus': []}"])
def test_a_broken_profile_fails_with_json_s_own_error(text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as host:
        smi.host_profile(text)
    with pytest.raises(json.JSONDecodeError) as machine:
        json.loads(text)
    assert str(host.value) == str(machine.value)


def test_hanging_host_ignores_sigterm(tmp_path: Path) -> None:
    """A wedged driver: the call blocks and only SIGKILL ends it, as `timeout -k` expects."""
    smi.write_host_files(tmp_path, dataclasses.replace(smi.make_profile(1), hang=True))
    proc = subprocess.Popen(_host_argv(tmp_path, "--version"), stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        # SigIgn is a hex mask: bit 14 is SIGTERM (15)
        while not int(_status(proc.pid).get("SigIgn", "0"), 16) & (1 << (signal.SIGTERM - 1)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and proc.stdout is not None and proc.stdout.read() == b""
    proc.stdout.close()


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def test_no_gpu_box_has_no_nvidia_smi(tmp_path: Path) -> None:
    smi.write_host_files(tmp_path, None)
    assert not (tmp_path / "usr/bin/nvidia-smi").exists()
