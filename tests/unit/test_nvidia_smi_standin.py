"""The nvidia-smi stand-in against the real recordings: byte for byte where a real box would print the same."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_host_files_run_as_nvidia_smi(tmp_path: Path) -> None:
    """What a host runs: the installed wrapper's profile, through this file as a script (stdlib only)."""
    smi.write_host_files(tmp_path, smi.make_profile(2, seed="h"))
    profile = tmp_path / smi.HOST_PROFILE.lstrip("/")
    out = subprocess.run(
        [sys.executable, str(tmp_path / smi.HOST_MODULE.lstrip("/")), str(profile), "--query-gpu=bogus", "--format=csv"],
        capture_output=True,
        text=True,
    )
    assert (out.stdout, out.returncode) == smi._read(RECORDINGS / "h200-2gpu", "bad-field.txt")
    assert "/usr/bin/python3" in (tmp_path / "usr/bin/nvidia-smi").read_text()


def test_no_gpu_box_has_no_nvidia_smi(tmp_path: Path) -> None:
    smi.write_host_files(tmp_path, None)
    assert not (tmp_path / "usr/bin/nvidia-smi").exists()
