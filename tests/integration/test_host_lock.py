"""One run per host at a time, on a real test host: two operators at once, and a controller killed mid-run.

Both faults use the real CLI (`pyinfra INVENTORY deploys/qwen35.py`) in processes of their own, started with Popen
and, for the kill, ended by their PID. The host's lease is short (LEASE_S) so a lock left behind would show within
the test, not after the default 90 s.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.hostlock import LOCK_PATH
from tests.integration.conftest import PYINFRA
from tests.integration.test_deploy_qwen35 import DEPLOY, SERVICE, deploy, write_inventory

LEASE_S = 6
UNIT = f"/etc/systemd/system/{SERVICE}.service"


def start(inventory: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [PYINFRA, "-y", str(inventory), DEPLOY], stdout=out, stderr=subprocess.STDOUT, text=True
        )


def max_num_seqs(fleet, host) -> tuple[str, str]:
    """--max-num-seqs as the unit has it, and as the running container was started with."""
    unit = fleet.read_file(host, UNIT).decode()
    args = json.loads(
        fleet.run_in(
            host, f"docker inspect --format '{{{{json .Args}}}}' $(docker ps -q --filter label=gpufleet.{SERVICE})"
        ).stdout
    )
    return unit.split("--max-num-seqs ", 1)[1].split()[0], args[args.index("--max-num-seqs") + 1]


@pytest.fixture(scope="module")
def serving(module_host, fleet, pyinfra, tmp_path_factory):
    """The module's host converged and serving, with the short lease."""
    inv = write_inventory(
        tmp_path_factory.mktemp("inv"),
        fleet.write_inventory(),
        [module_host.name],
        {module_host.name: {"gpufleet_lock_lease_s": LEASE_S}},
    )
    deploy(pyinfra, inv)
    return module_host


def test_of_two_concurrent_runs_one_is_refused_naming_the_other_and_the_winner_is_what_runs(serving, fleet, tmp_path):
    name = serving.name
    runs = {}
    for seqs in (4, 6):
        inv = write_inventory(
            tmp_path,
            fleet.write_inventory(),
            [name],
            {name: {"gpufleet_lock_lease_s": LEASE_S, "vllm_args": {"max-num-seqs": seqs}}},
        )
        runs[seqs] = start(inv, tmp_path / f"run-{seqs}.log")
    for proc in runs.values():
        proc.wait(timeout=600)
    outputs = {seqs: (tmp_path / f"run-{seqs}.log").read_text() for seqs in runs}

    refused = [seqs for seqs, proc in runs.items() if proc.returncode != 0]
    assert len(refused) == 1, outputs
    (loser,) = refused
    (winner,) = set(runs) - {loser}
    holder = f"{name}: locked by {getpass.getuser()}@{socket.gethostname()} pid {runs[winner].pid} since "
    lock_lines = [line for line in outputs[loser].splitlines() if "locked by" in line]
    assert len(lock_lines) == 1 and lock_lines[0].strip().startswith(holder), outputs[loser][-3000:]
    assert "nothing was changed on any host" in outputs[loser]
    assert "locked by" not in outputs[winner] and "ready: /health 200" in outputs[winner]
    assert max_num_seqs(fleet, serving) == (str(winner), str(winner))


def test_a_killed_controllers_lock_is_taken_over_within_the_lease(serving, fleet, tmp_path):
    name = serving.name
    inv = write_inventory(
        tmp_path,
        fleet.write_inventory(),
        [name],
        {name: {"gpufleet_lock_lease_s": LEASE_S, "vllm_args": {"max-num-seqs": 5}}},
    )
    log = tmp_path / "killed.log"
    killed = start(inv, log)
    deadline = time.monotonic() + 300
    # The settings change restarted the service; the run is now waiting for it to get ready (or soaking it).
    while "Verify vLLM is ready" not in log.read_text():
        assert killed.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1)
    assert killed.poll() is None, log.read_text()[-3000:]
    assert f"pid={killed.pid} " in fleet.run_in(serving, f"cat {LOCK_PATH}").stdout
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)

    again = write_inventory(
        tmp_path,
        fleet.write_inventory(),
        [name],
        {
            name: {
                "gpufleet_lock_lease_s": LEASE_S,
                "gpufleet_lock_wait_s": LEASE_S + 4,
                "vllm_args": {"max-num-seqs": 5},
            }
        },
    )
    started = time.monotonic()
    rerun = subprocess.run(
        [PYINFRA, "-y", str(again), DEPLOY], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    assert "locked by" not in rerun.stdout
    assert f"pid={killed.pid} " not in fleet.run_in(serving, f"cat {LOCK_PATH}").stdout
    assert max_num_seqs(fleet, serving) == ("5", "5")
    print(f"re-run after the kill took {time.monotonic() - started:.1f} s")
