"""nvidia-smi facts, parsed from output recorded on real H200 hosts (tests/fixtures/nvidia-smi/)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from gpufleet.facts.nvidia import QUERY_GPUS, parse_gpus, parse_topology, parse_version

FIXTURES = Path(__file__).parent.parent / "fixtures" / "nvidia-smi"


def recorded(kind: str, name: str) -> list[str]:
    """A recording's stdout lines, without the `rc=` trailer the recorder appended."""
    lines = (FIXTURES / kind / name).read_text().splitlines()
    return [line for line in lines if not line.startswith("rc=")]


def test_query_command_is_the_recorded_one():
    readme = (FIXTURES / "h200-2gpu" / "README.md").read_text()
    assert f"`{QUERY_GPUS}`" in readme


@pytest.mark.parametrize(("kind", "count"), [("h200-1gpu", 1), ("h200-2gpu", 2)])
def test_gpus_count_memory_and_driver(kind, count):
    gpus = parse_gpus(recorded(kind, "query-gpu.csv"))
    assert len(gpus) == count
    assert [g.index for g in gpus] == list(range(count))
    for gpu in gpus:
        assert gpu.name == "NVIDIA H200"
        assert gpu.memory_total_mib == 143771
        assert gpu.memory_free_mib == 143156
        assert gpu.driver_version == "580.159.04"
        assert gpu.compute_cap == "9.0"
        assert gpu.power_limit_w == 700.0
    assert len({g.uuid for g in gpus}) == count


def test_count_matches_the_recorded_count_query():
    gpus = parse_gpus(recorded("h200-2gpu", "query-gpu.csv"))
    assert len(gpus) == int(recorded("h200-2gpu", "count.txt")[0])


@pytest.mark.parametrize("kind", ["h200-1gpu", "h200-2gpu"])
def test_driver_and_cuda_version(kind):
    version = parse_version(recorded(kind, "version.txt"))
    assert version.driver_version == "580.159.04"
    assert version.cuda_version == "13.0"
    assert version.cuda == (13, 0)
    assert version.cuda >= (12, 9) and not version.cuda >= (13, 1)


def test_topology_two_gpus_nvlink():
    topo = parse_topology(recorded("h200-2gpu", "topo.txt"))
    assert topo.gpus == (0, 1)
    assert topo.link(0, 1) == "NV18" and topo.link(1, 0) == "NV18"
    assert topo.nvlinks(0, 1) == 18
    assert topo.link(0, 0) == "X" and topo.nvlinks(0, 0) == 0


def test_topology_one_gpu():
    topo = parse_topology(recorded("h200-1gpu", "topo.txt"))
    assert topo.gpus == (0,)
    assert topo.links == {(0, 0): "X"}


@pytest.mark.parametrize("name", ["bad-field.txt", "bad-index.txt"])
def test_nvidia_smi_error_output_is_a_clear_error(name):
    with pytest.raises(FactProcessError, match="nvidia-smi failed"):
        parse_gpus(recorded("h200-2gpu", name))


def test_wrong_field_count_names_the_line():
    header = recorded("h200-1gpu", "query-gpu-header.csv")  # a different query's output
    with pytest.raises(FactProcessError, match=r"line 1: expected 14 comma-separated fields"):
        parse_gpus(header)


def test_non_numeric_memory_is_a_clear_error():
    line = recorded("h200-1gpu", "query-gpu.csv")[0].replace("143771", "lots")
    with pytest.raises(FactProcessError, match="line 1"):
        parse_gpus([line])


def test_version_without_cuda_line_is_a_clear_error():
    with pytest.raises(FactProcessError, match="CUDA Version"):
        parse_version(["NVIDIA-SMI version  : 580.159.04"])


def test_topology_garbage_is_a_clear_error():
    with pytest.raises(FactProcessError, match="topo"):
        parse_topology(["something else entirely"])
