"""Faults of the host's own state on a real test host (nspawn, SSH, systemd, dockerd, the stand-in images): a full
disk before the commit, a controller killed right after its rollback put the committed unit back, a controller
frozen past its lease, a local user holding a lock file or squatting pyinfra's upload names, a ledger naming a
service outside its directory; then the controller's link cut during a soak, a local user's listener on the
service's port, a prepare that hangs in a rollout, and a reboot during a rename's soak.

One fresh host, steps in file order (pytest keeps it), each starting from a host serving a committed version:
converge on `good` -> disk full before the commit of `good-next`, then `dies` rolled back -> `dies` (other settings)
with the controller killed after the rollback restored the unit -> a controller SIGSTOPped past its lease while
another run commits, then a million-second lease held for the run -> a local user's flocks -> `dies` rolled back
with the upload names squatted -> a ledger whose service is `../x` -> the link cut for 10 s during the soak of
good-next with max-num-seqs 7 (the setting every later step keeps) -> a listener on 127.0.0.1:<port> (the host
given an API key) -> a rollout whose prepare hangs -> a rename with a reboot during its soak (the host ends on
vllm-renamed).

The controllers are the real CLI (`pyinfra INVENTORY deploys/qwen35.py`) in processes of their own, signalled by the
PID this test started. Files that a tmpfs mounted inside the host may hide are read inside the host (`base64`), not
from the host's root directory seen from outside.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gpufleet.hostlock import LOCK_PATH
from gpufleet.hoststate.paths import STATE_DIR, UNITS_DIR, committed_unit
from gpufleet.sandbox.config import REGISTRY_PORT
from gpufleet.sandbox.image import image_ref
from tests.integration.conftest import PYINFRA
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_crash_safe_ledger import container_ids, digest_of, health_on, main_pid, one_line
from tests.integration.test_deploy_qwen35 import DEPLOY, SERVICE, STATE_FILE, deploy, running_image, sh, write_inventory

UNIT = f"/etc/systemd/system/{SERVICE}.service"
DATA = {"vllm_ready_timeout": 60, "vllm_ready_soak_s": 5}
PORT = 5000  # the sandbox's vllm_port (the default)
LEASE_S = 6  # short, so a frozen controller loses the host within the test (heartbeats every LEASE_S / 4)
OLD_LOCK_PATH = "/run/lock/gpufleet.lock"  # where gpufleet kept the lock before /run/gpufleet (git log -S /run/lock)
LOCAL_USER = "nobody"


@pytest.fixture(scope="module")
def host(module_host):
    return module_host


@pytest.fixture(scope="module")
def inventory(host, fleet, tmp_path_factory):
    """inventory(**settings) -> a pyinfra inventory of the host with these settings over DATA (vllm_image: good)."""
    tmp = tmp_path_factory.mktemp("faults")

    def write(**settings):
        data = {**DATA, "vllm_image": image_ref(fleet.cfg, "good"), **settings}
        return write_inventory(tmp, fleet.write_inventory(), [host.name], {host.name: data})

    return write


@pytest.fixture(scope="module")
def good(host, fleet, inventory, pyinfra):
    """The host converged and verified on the good image; its committed digest."""
    deploy(pyinfra, inventory())
    return ledger_doc(fleet, host)["committed"]["ref"]


# --- helpers -------------------------------------------------------------------------------------------------
def read(fleet, host, path: str) -> bytes:
    """A file as the host's own processes see it (through any mount inside the host)."""
    return base64.b64decode(sh(fleet, host, f"base64 -w0 {path}"))


def ledger_doc(fleet, host) -> dict:
    return json.loads(read(fleet, host, STATE_FILE))


def kept_unit(fleet, host) -> bytes:
    """The committed unit's copy, the one the ledger names by its checksum."""
    return read(fleet, host, committed_unit(SERVICE, ledger_doc(fleet, host)["committed"]["unit_sha256"]))


def stamp(fleet, host, *paths: str) -> str:
    """Every file under paths with its modification time (ns), size and sha256: what a write would change."""
    return sh(fleet, host, f"find {' '.join(paths)} -type f -printf '%p %T@ %s ' -exec sha256sum {{}} \\; | sort")


def start(inv: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([PYINFRA, "-y", str(inv), DEPLOY], stdout=out, stderr=subprocess.STDOUT, text=True)


def reap(proc: subprocess.Popen) -> None:
    """The controller killed and waited for if it still runs: no run outlives its test."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, f"never saw {text!r}:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def finish(proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> str:
    proc.wait(timeout=timeout_s)
    return log.read_text()


def host_line(out: str, host, *parts: str) -> str:
    """The one line naming the host (`host: ...`, after pyinfra's `[host]` prefix when it has one) with parts."""
    lines = [line.strip().removeprefix(f"[{host.name}]").strip() for line in out.splitlines()]
    found = [line for line in lines if line.startswith(f"{host.name}: ") and all(p in line for p in parts)]
    assert len(found) == 1, out[-4000:]
    return found[0]


def at_rest(fleet, host, pyinfra, inv, committed: str) -> None:
    """The host serves the committed digest on its port, and a converge of `inv` changes nothing."""
    assert running_image(fleet, host) == committed and health_on(fleet, host, PORT) == "200"
    out = deploy(pyinfra, inv).stdout
    assert changes(out) == 0, changed_ops(out)


# --- 1. disk full before the commit ----------------------------------------------------------------------------
FILL = f"{STATE_DIR}/fill"


def fill_state_dir(fleet, host) -> None:
    """A small tmpfs over /var/lib/gpufleet holding the files that were there, then filled up: writes there get
    ENOSPC, as on a full disk."""
    fleet.run_in(
        host,
        f"rm -rf /tmp/gf-seed && cp -a {STATE_DIR} /tmp/gf-seed && "
        f"mount -t tmpfs -o size=2m,mode=0755 gf-full {STATE_DIR} && cp -a /tmp/gf-seed/. {STATE_DIR}/ && "
        f"rm -rf /tmp/gf-seed && {{ dd if=/dev/zero of={FILL} bs=4k 2>/dev/null; true; }}",
    )
    probe = fleet.run_in(host, f"dd if=/dev/zero of={STATE_DIR}/.probe bs=4k count=1", check=False)
    assert probe.returncode != 0 and "No space left on device" in probe.stderr, probe


def unmount_state_dir(fleet, host) -> None:
    """The state back on the host's disk (the tmpfs's files copied under it), the tmpfs gone."""
    fleet.run_in(
        host,
        f"if mountpoint -q {STATE_DIR}; then rm -f {FILL} {STATE_DIR}/.probe && "
        f"rm -rf /tmp/gf-state && cp -a {STATE_DIR} /tmp/gf-state && umount {STATE_DIR} && "
        f"find {STATE_DIR} -mindepth 1 -delete && cp -a /tmp/gf-state/. {STATE_DIR}/ && "
        "rm -rf /tmp/gf-state; fi",
    )


def test_a_full_disk_before_the_commit_fails_without_committing_and_a_later_rollback_restores_the_unit(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    nxt, dies = digest_of(fleet, "good-next"), digest_of(fleet, "dies")
    unit = read(fleet, host, UNIT)
    assert kept_unit(fleet, host) == unit
    log = tmp_path / "full.log"
    proc = start(inventory(gpufleet_image_ref=nxt, vllm_ready_soak_s=20), log)
    try:
        wait_for(log, "watching it for 20 s", proc)  # pending written, unit replaced, restarted: on probation
        fill_state_dir(fleet, host)
        at_fill = read(fleet, host, STATE_FILE)
        out = finish(proc, log)
        assert proc.returncode != 0, out[-4000:]
        line = host_line(out, host, "could not keep a copy of the verified unit")
        assert "No space left on device" in line and "(fix: check the free space of" in line, line
        print(line)
        assert "Traceback" not in out and f"committed {nxt}" not in out
        # Not committed: the ledger is what it was when the disk filled (the new version pending), no copy of its unit.
        assert read(fleet, host, STATE_FILE) == at_fill
        doc = json.loads(at_fill)
        assert doc["committed"]["ref"] == good and doc["pending"]["ref"] == nxt
        assert sh(fleet, host, f"ls -A {UNITS_DIR}").split() == [
            committed_unit(SERVICE, doc["committed"]["unit_sha256"]).rsplit("/", 1)[1]
        ]

        fleet.run_in(host, f"rm -f {FILL}")  # the space freed
        out = deploy(pyinfra, inventory(gpufleet_image_ref=dies, vllm_ready_soak_s=20), check=False).stdout
        line = one_line(out, host, f"new image {dies} failed verification")
        assert f"; rolled back to {good}, which is ready (fix: " in line, line
        assert read(fleet, host, UNIT) == unit == kept_unit(fleet, host)  # byte for byte
        assert running_image(fleet, host) == good and health_on(fleet, host, PORT) == "200"
        doc = ledger_doc(fleet, host)
        assert doc["committed"]["ref"] == good and doc["pending"] is None and doc["failed"][-1]["ref"] == dies
    finally:
        reap(proc)
        unmount_state_dir(fleet, host)
    at_rest(fleet, host, pyinfra, inventory(), good)


# --- 2. SIGKILL right after the rollback restored the unit -------------------------------------------------------
def test_killed_right_after_the_rollback_restored_the_unit_keeps_the_failure_mark(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    dies, unit = digest_of(fleet, "dies"), read(fleet, host, UNIT)
    inv = inventory(gpufleet_image_ref=dies, vllm_ready_soak_s=20, vllm_args={"max-num-seqs": 3})  # a spec not failed
    log = tmp_path / "killed.log"
    proc = start(inv, log)
    try:
        wait_for(log, f"rolling back to {good}", proc)  # the failure mark is written; the unit goes back next
        deadline = time.monotonic() + 60
        while fleet.read_file(host, UNIT) != unit:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        reap(proc)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-4000:]
    print(
        "at the kill:",
        sh(fleet, host, f"systemctl show -p ActiveState -p NeedDaemonReload -p MainPID {SERVICE}"),
        running_image(fleet, host),
    )
    doc = ledger_doc(fleet, host)
    assert doc["committed"]["ref"] == good and doc["pending"] is None
    assert doc["failed"][-1]["ref"] == dies and doc["failed"][-1]["reason"].startswith("dead: ")

    # The re-run of the same converge does not try dies again: refused at preflight, nothing changed.
    again = deploy(pyinfra, inv, check=False)
    assert again.returncode != 0, again.stdout[-4000:]
    mark = doc["failed"][-1]
    refused = one_line(again.stdout, host, f"{dies} with spec {mark['spec_hash']} and model {mark['model']} failed at ")
    assert "gpufleet_retry_failed=true" in refused and "nothing was changed" in again.stdout
    print(refused)
    assert ledger_doc(fleet, host) == doc
    # A plain converge settles what the kill left (a restart the rollback may not have finished), then rests.
    deploy(pyinfra, inventory())
    assert read(fleet, host, UNIT) == unit == kept_unit(fleet, host)
    assert ledger_doc(fleet, host)["failed"] == doc["failed"]
    at_rest(fleet, host, pyinfra, inventory(), good)


# --- 3. a controller frozen past its lease; a lease of a million seconds -----------------------------------------
def test_a_controller_stopped_past_its_lease_writes_nothing_after_another_run_committed(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    nxt = digest_of(fleet, "good-next")
    log = tmp_path / "stopped.log"
    a = start(inventory(gpufleet_image_ref=nxt, vllm_ready_soak_s=60, gpufleet_lock_lease_s=LEASE_S), log)
    try:
        wait_for(log, "watching it for 60 s", a)
        os.kill(a.pid, signal.SIGSTOP)
        time.sleep(LEASE_S + 4)  # past the lease: the host's side of A's lock gave up waiting for a heartbeat
        b = deploy(pyinfra, inventory(gpufleet_image_ref=nxt, gpufleet_lock_wait_s=LEASE_S)).stdout
        assert f"committed {nxt}" in b and "locked by" not in b, b[-4000:]
        assert f"pid={a.pid} " not in sh(fleet, host, f"cat {LOCK_PATH}")
        after_b = stamp(fleet, host, STATE_DIR, UNIT)
        pid, committed = main_pid(fleet, host), ledger_doc(fleet, host)["committed"]
        assert committed["ref"] == nxt
        os.kill(a.pid, signal.SIGCONT)
        out = finish(a, log)
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
        reap(a)
    assert a.returncode != 0, out[-4000:]
    print(host_line(out, host, f"{STATE_FILE} not written: this run no longer holds the host"))
    # A wrote nothing: the ledger (bytes and mtime), the kept unit and the unit file are as B left them.
    now = stamp(fleet, host, STATE_DIR, UNIT)
    assert now == after_b, "written by A after it lost the host (path mtime size sha256):\n" + "\n".join(
        sorted(set(now.splitlines()) - set(after_b.splitlines()))
    )
    assert main_pid(fleet, host) == pid and running_image(fleet, host) == nxt
    at_rest(fleet, host, pyinfra, inventory(gpufleet_image_ref=nxt), nxt)


def test_a_million_second_lease_holds_the_lock_for_the_run(good, host, fleet, inventory, pyinfra, tmp_path):
    nxt = digest_of(fleet, "good-next")
    log = tmp_path / "long-lease.log"
    held = start(
        inventory(
            gpufleet_image_ref=nxt, vllm_ready_soak_s=20, vllm_args={"max-num-seqs": 5}, gpufleet_lock_lease_s=1000000
        ),
        log,
    )
    try:
        wait_for(log, "watching it for 20 s", held)
        time.sleep(3)
        assert f"pid={held.pid} " in sh(fleet, host, f"cat {LOCK_PATH}")
        other = deploy(pyinfra, inventory(gpufleet_image_ref=nxt), check=False)
        assert held.poll() is None, log.read_text()[-4000:]  # refused while the long-lease run was still running
        out = finish(held, log)
    finally:
        reap(held)
    assert other.returncode != 0, other.stdout[-4000:]
    line = one_line(other.stdout, host, "locked by")
    assert line.startswith(f"{host.name}: locked by {getpass.getuser()}@{socket.gethostname()} pid {held.pid} since ")
    assert "nothing was changed on any host" in other.stdout
    assert held.returncode == 0 and f"committed {nxt}" in out, out[-4000:]
    assert " --max-num-seqs 5 " in read(fleet, host, UNIT).decode()


# --- 4. a local user holding flock on the lock paths -------------------------------------------------------------
def test_a_local_users_flock_on_the_old_lock_path_does_not_block_a_converge(good, host, fleet, inventory, pyinfra):
    nxt = digest_of(fleet, "good-next")
    inv = inventory(gpufleet_image_ref=nxt, vllm_args={"max-num-seqs": 5})
    # The lock's directory is root's alone: a local user can neither open the lock there nor make the directory.
    assert sh(fleet, host, "stat -c '%U %a' /run/gpufleet").split() == ["root", "700"]
    for attempt in (f"flock -n {LOCK_PATH} true", "flock -n /run/gpufleet true"):
        denied = fleet.run_in(host, f"runuser -u {LOCAL_USER} -- {attempt}", check=False)
        assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    # In world-writable /run/lock, where gpufleet locked before, any local user can hold a flock.
    fleet.run_in(host, f"systemd-run --quiet --unit=gf-squatter --uid={LOCAL_USER} flock {OLD_LOCK_PATH} sleep 600")
    try:
        deadline = time.monotonic() + 30
        while fleet.run_in(host, f"flock -n {OLD_LOCK_PATH} true", check=False).returncode == 0:
            assert time.monotonic() < deadline, "the local user never took the old lock"
            time.sleep(0.2)
        out = deploy(pyinfra, inv).stdout
        assert "locked by" not in out and changes(out) == 0, changed_ops(out)
        out = deploy(pyinfra, inventory(gpufleet_image_ref=nxt, vllm_args={"max-num-seqs": 6})).stdout
        assert "locked by" not in out and f"committed {nxt}" in out, out[-4000:]
        assert fleet.run_in(host, f"flock -n {OLD_LOCK_PATH} true", check=False).returncode != 0  # still held
    finally:
        fleet.run_in(host, "systemctl stop gf-squatter", check=False)


# --- 4b. a local user squatting pyinfra's fixed upload names ---------------------------------------------------------
def pyinfra_staging_name(path: str) -> str:
    """Where pyinfra's sudo upload of `path` would stage it: /tmp/pyinfra-<sha1 of the path> (a fixed name)."""
    return f"/tmp/pyinfra-{hashlib.sha1(path.encode()).hexdigest()}"


def test_a_local_user_squatting_the_upload_names_blocks_no_write_and_no_rollback(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    dies, unit = digest_of(fleet, "dies"), read(fleet, host, UNIT)
    committed = ledger_doc(fleet, host)["committed"]
    # The names the ledger's and the unit's uploads were staged under, taken first by `nobody`.
    squatted = [
        pyinfra_staging_name(f"{STATE_DIR}/.{SERVICE}.json.upload"),
        pyinfra_staging_name(f"/etc/systemd/system/.{SERVICE}.service.gpufleet-tmp"),
    ]
    fleet.run_in(host, " && ".join(f"runuser -u {LOCAL_USER} -- mkdir -m 755 {name}" for name in squatted))
    try:
        # The pending record, the new unit, the failure mark: each a write through the squatted names.
        out = deploy(
            pyinfra,
            inventory(gpufleet_image_ref=dies, vllm_ready_soak_s=20, vllm_args={"max-num-seqs": 8}),
            check=False,
        ).stdout
        line = one_line(out, host, f"new image {dies} failed verification")
        assert f"; rolled back to {committed['ref']}, which is ready (fix: " in line, line
        assert read(fleet, host, UNIT) == unit and running_image(fleet, host) == committed["ref"]
        doc = ledger_doc(fleet, host)
        assert doc["committed"] == committed and doc["pending"] is None and doc["failed"][-1]["ref"] == dies
        assert sh(fleet, host, f"stat -c %U {' '.join(squatted)}").split() == [LOCAL_USER] * 2  # left as they were
    finally:
        fleet.run_in(host, f"rm -rf {' '.join(squatted)}")


# --- 5. a ledger naming service ../x ----------------------------------------------------------------------------
def test_a_ledger_naming_a_service_outside_its_directory_is_refused_and_nothing_touched(
    good, host, fleet, inventory, pyinfra
):
    whole = read(fleet, host, STATE_FILE)
    doc = json.loads(whole)
    doc["committed"]["service"] = "../x"
    edited = json.dumps(doc, indent=2).encode() + b"\n"
    fleet.run_in(host, f"echo {base64.b64encode(edited).decode()} | base64 -d > {STATE_FILE}")
    unit, pid = read(fleet, host, UNIT), main_pid(fleet, host)
    try:
        proc = deploy(
            pyinfra, inventory(gpufleet_image_ref=doc["committed"]["ref"], vllm_args={"max-num-seqs": 4}), check=False
        )
        assert proc.returncode != 0, proc.stdout[-4000:]
        line = one_line(proc.stdout, host, f"{STATE_FILE} is corrupt", "'../x'")
        assert "is not a service name" in line and "(fix: repair it by hand, or move it away" in line, line
        print(line)
        assert "nothing was changed on any host" in proc.stdout and "Traceback" not in proc.stdout
        assert read(fleet, host, STATE_FILE) == edited and read(fleet, host, UNIT) == unit
        assert main_pid(fleet, host) == pid
        assert sh(fleet, host, "ls /var/lib/x.json /etc/systemd/x.service 2>/dev/null || true") == ""
    finally:
        fleet.run_in(host, f"echo {base64.b64encode(whole).decode()} | base64 -d > {STATE_FILE}")
    assert read(fleet, host, STATE_FILE) == whole


# --- 6. the controller's link to the host cut for 10 s during the soak --------------------------------------------
API_KEY = "sk-gf-faults-5d0c2e71"
MAX_SEQS = 7  # a setting no step above committed: the steps below all converge to it
GPUFLEET = str(Path(PYINFRA).with_name("gpufleet"))
REPO_ROOT = Path(DEPLOY).resolve().parents[1]


def base(fleet, **settings) -> dict:
    """The steps' settings from here on: good-next, max-num-seqs MAX_SEQS (and what `settings` add)."""
    return {"gpufleet_image_ref": digest_of(fleet, "good-next"), "vllm_args": {"max-num-seqs": MAX_SEQS}, **settings}


def gpufleet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The gpufleet CLI from the checkout; stdout (a --json document) and stderr (progress) apart."""
    return subprocess.run([GPUFLEET, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def reachable(host, port: int = 22, timeout_s: float = 1.0) -> bool:
    try:
        socket.create_connection((host.ip, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def test_the_link_cut_for_10_s_during_the_soak_neither_rolls_back_nor_marks_the_version(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    settings = base(fleet)
    nxt = settings["gpufleet_image_ref"]
    before = ledger_doc(fleet, host)
    log = tmp_path / "link.log"
    proc = start(inventory(**settings, vllm_ready_soak_s=40), log)
    try:
        wait_for(log, "watching it for 40 s", proc)  # restarted into the new spec, on probation
        time.sleep(6)
        fleet.set_connected(host, False)  # the controller's side of the host's link (its veth) down: the host runs on
        cut_at = time.monotonic()
        assert not reachable(host), "the host still answered on its SSH port with its link down"
        time.sleep(max(0.0, 10 - (time.monotonic() - cut_at)))
        fleet.set_connected(host, True)
        print(f"link down for {time.monotonic() - cut_at:.1f} s, from about 6 s into the 40 s soak")
        out = finish(proc, log)
    finally:
        fleet.set_connected(host, True)
        reap(proc)
    # Back 15 s into a 40 s soak: the host said nothing against the version, and the soak saw it answer again.
    assert "rolling back" not in out and "Traceback" not in out, out[-4000:]
    assert proc.returncode == 0 and f"committed {nxt}" in out, out[-4000:]
    doc = ledger_doc(fleet, host)
    assert doc["failed"] == before["failed"]  # no failure mark
    assert doc["committed"]["ref"] == nxt and doc["pending"] is None
    assert f" --max-num-seqs {MAX_SEQS} " in read(fleet, host, UNIT).decode()
    at_rest(fleet, host, pyinfra, inventory(**settings), nxt)


# --- 7. a local user's listener on 127.0.0.1:<port> ---------------------------------------------------------------
LISTENER = r"""
import http.server, os, sys

port, log, answers, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
# What a forger would hand root: gpufleet's section marker, then a ledger of its own.
FORGED = b'\n@@gpufleet:state\n@@present\n{"committed": {"ref": "evil/vllm@sha256:' + b'0' * 64 + b'"}}\n@@gpufleet:end\n'


class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(log, "a") as f:  # every request, with any Authorization header it carried
            f.write(f"{self.path} authorization={self.headers.get('Authorization', '-')}\n")
        name = {"/v1/models": "models", "/version": "version", "/metrics": "metrics"}.get(self.path)
        body = b"" if name is None else open(os.path.join(answers, name), "rb").read()
        if mode == "forge" and name == "models":
            body += FORGED
        self.send_response(200)
        self.send_header("Content-Type", "text/plain" if name == "metrics" else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", port), Answer).serve_forever()
"""


class Squatter:
    """A listener as `nobody` on 127.0.0.1:PORT in the host's network namespace, answering like the vLLM the host
    served (its own /v1/models, /version and /metrics, copied before), and logging each request's Authorization."""

    def __init__(self, fleet, host, place: Path):
        self.fleet, self.host, self.place = fleet, host, place
        self.log = place / "requests.log"
        self.proc: subprocess.Popen | None = None

    def copy_answers(self) -> None:
        cip = (
            "$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "
            f"$(docker ps -q --filter label=gpufleet.{SERVICE}))"
        )
        for name, path in (("models", "/v1/models"), ("version", "/version"), ("metrics", "/metrics")):
            body = sh(
                self.fleet,
                self.host,
                f"curl -fsS --max-time 5 -H 'Authorization: Bearer {API_KEY}' http://{cip}:{PORT}{path}",
            )
            (self.place / name).write_text(body)
        (self.place / "listener.py").write_text(LISTENER)
        self.log.touch()
        for p in (self.place, *self.place.iterdir()):
            p.chmod(0o777 if p in (self.place, self.log) else 0o644)

    def start(self, mode: str) -> None:
        self.proc = subprocess.Popen(  # ip netns exec and setpriv exec: this PID is the listener's
            [
                "ip",
                "netns",
                "exec",
                self.host.netns,
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                str(self.place / "listener.py"),
                str(PORT),
                str(self.log),
                str(self.place),
                mode,
            ]
        )
        deadline = time.monotonic() + 30
        while health_on(self.fleet, self.host, PORT) != "200":
            assert self.proc.poll() is None, f"the listener exited {self.proc.returncode}"
            assert time.monotonic() < deadline, "the listener never answered"
            time.sleep(0.2)
        owner = sh(self.fleet, self.host, f"ss -Hltnp 'sport = :{PORT}'")
        assert f"127.0.0.1:{PORT}" in owner, owner

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def requests(self) -> list[str]:
        return self.log.read_text().splitlines()


def test_a_local_users_listener_on_the_port_gets_no_key_fakes_no_readiness_and_forges_no_section(
    good, host, fleet, inventory, pyinfra
):
    settings = base(fleet, vllm_api_key=API_KEY)
    inv = inventory(**settings)
    deploy(pyinfra, inv)  # the key on the host; the labelled container runs
    doc = ledger_doc(fleet, host)
    place = Path(tempfile.mkdtemp(prefix="gf-squatter-"))
    squatter = Squatter(fleet, host, place)
    squatter.copy_answers()
    try:
        fleet.run_in(host, f"systemctl stop {SERVICE}")
        squatter.start("plain")
        # A verify of the host with no container running is not ready, whatever answers on 127.0.0.1:<port>.
        verify = gpufleet("verify", str(inv), "--json")
        assert verify.returncode != 0, verify.stdout[-4000:] + verify.stderr[-2000:]
        state = {h["host"]: (h.get("state"), h.get("detail")) for h in json.loads(verify.stdout)["hosts"]}
        print("verify:", state[host.name])
        assert state[host.name][0] == "container-not-running", verify.stdout[-4000:]

        # A listener whose /v1/models carries gpufleet's section marker and a ledger of its own: refused.
        squatter.stop()
        squatter.start("forge")
        whole = read(fleet, host, STATE_FILE)
        out = deploy(pyinfra, inv, check=False)
        assert out.returncode != 0 and "Traceback" not in out.stdout, out.stdout[-4000:]
        print(host_line(out.stdout, host, "host snapshot refused"))
        assert "nothing was changed" in out.stdout
        assert read(fleet, host, STATE_FILE) == whole and json.loads(whole)["committed"] == doc["committed"]
        assert any(r.startswith("/v1/models") for r in squatter.requests())  # it was asked, and answered

        # The plain listener again: the converge restarts the service; docker publishes the port on 0.0.0.0.
        squatter.stop()
        squatter.start("plain")
        out = deploy(pyinfra, inv, check=False)
        print("requests the listener saw:", squatter.requests())
        assert all(r.endswith(" authorization=-") for r in squatter.requests()), squatter.requests()  # no key
        assert "Traceback" not in out.stdout
        after = ledger_doc(fleet, host)
        assert after["committed"] == doc["committed"] and after["failed"] == doc["failed"]  # nothing faked, no mark
        verify = gpufleet("verify", str(inv), "--json")
        state = {h["host"]: (h.get("state"), h.get("detail")) for h in json.loads(verify.stdout)["hosts"]}
        print("converge exited", out.returncode, "; verify after it:", verify.returncode, state[host.name])
        assert (verify.returncode == 0) == (out.returncode == 0) == (state[host.name][0] == "ready"), state
        if out.returncode == 0:  # the container started despite the listener: verified at its own address
            assert len(container_ids(fleet, host)) == 1 and running_image(fleet, host) == doc["committed"]["ref"]
        else:  # docker could not publish the port: one line for the host says so, naming the port
            failed = [line for line in out.stdout.splitlines() if host.name in line and "not ready" in line]
            assert len(failed) == 1, out.stdout[-4000:]
            print(failed[0])
            assert f"port {PORT}" in failed[0] or f":{PORT}" in failed[0], out.stdout[-4000:]
    finally:
        squatter.stop()
        shutil.rmtree(place, ignore_errors=True)
    deploy(pyinfra, inv)
    at_rest(fleet, host, pyinfra, inv, doc["committed"]["ref"])


# --- 8. a prepare that hangs ----------------------------------------------------------------------------------------
STAGE_TIMEOUT_S = 20


def test_a_prepare_that_hangs_ends_at_the_stage_limit_and_releases_the_lock(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    settings = base(fleet, vllm_api_key=API_KEY)
    inv = inventory(**settings)
    deploy(pyinfra, inv)
    target = digest_of(fleet, "tools-broken")  # no step pulls it: prepare must fetch its layers
    assert target.split("@")[1] not in sh(fleet, host, "docker images --digests --no-trunc")
    doc, unit, pid, cids = (
        ledger_doc(fleet, host),
        read(fleet, host, UNIT),
        main_pid(fleet, host),
        container_ids(fleet, host),
    )
    # The host's packets to the registry are dropped (in the host's own network namespace): a pull there hangs.
    rule = ["OUTPUT", "-p", "tcp", "-d", fleet.cfg.gateway, "--dport", str(REGISTRY_PORT), "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-I", *rule], check=True)
    log = tmp_path / "rollout.log"
    try:
        t0 = time.monotonic()
        proc = gpufleet(
            "rollout",
            str(inv),
            "--image",
            target,
            "--yes",
            "--json",
            "--stage-timeout",
            str(STAGE_TIMEOUT_S),
            "--log",
            str(log),
            timeout=300,
        )
        took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-D", *rule], check=True)
    print(f"rollout exited {proc.returncode} after {took:.0f} s:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-4000:]
    assert "Starting operation: Deploy Qwen 3.5 on vLLM | Pull the vLLM image" in log.read_text()  # hung there
    assert STAGE_TIMEOUT_S <= took < STAGE_TIMEOUT_S + 60
    (row,) = json.loads(proc.stdout)["hosts"]
    assert row["host"] == host.name and row["outcome"] == "failed-prepare", row
    assert "\n" not in row["detail"] and f"time limit of {STAGE_TIMEOUT_S} s" in row["detail"], row
    # No host swapped: the same container, main PID, unit and ledger.
    assert container_ids(fleet, host) == cids and main_pid(fleet, host) == pid
    assert read(fleet, host, UNIT) == unit and ledger_doc(fleet, host) == doc
    # The host's lock went with the ended run: a converge right after is not refused.
    out = deploy(pyinfra, inv).stdout
    assert "locked by" not in out and changes(out) == 0, changed_ops(out)


# --- 9. a reboot during a rename's soak -----------------------------------------------------------------------------
RENAMED = "vllm-renamed"


def test_a_reboot_during_a_renames_soak_starts_one_container_and_a_rerun_settles_it(
    good, host, fleet, inventory, pyinfra, tmp_path
):
    settings = base(fleet, vllm_api_key=API_KEY)
    deploy(pyinfra, inventory(**settings))
    before = ledger_doc(fleet, host)
    log = tmp_path / "rename.log"
    proc = start(inventory(**settings, vllm_service=RENAMED, vllm_ready_soak_s=300), log)
    try:
        wait_for(log, "watching it for 300 s", proc)
        fleet.run_in(host, "touch /run/gf-before-reboot")  # /run is the boot's own tmpfs
        booted_at = time.time()
        took = fleet.reboot(host)
        assert sh(fleet, host, "ls /run/gf-before-reboot 2>/dev/null || true") == ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        reap(proc)
    print(f"rebooted in {took:.0f} s; the controller killed ({proc.returncode})")
    # After boot: the enabled unit (the new name's) starts its container, the old one stays stopped and disabled.
    deadline = time.monotonic() + 120
    while len(container_ids(fleet, host)) != 1 or health_on(fleet, host, PORT) != "200":
        assert time.monotonic() < deadline, sh(fleet, host, "docker ps -a; systemctl --all | grep vllm || true")
        time.sleep(1)
    time.sleep(5)  # a second one would have started by now
    assert len(container_ids(fleet, host)) == 1
    label = sh(fleet, host, "docker ps --format '{{.Labels}}'")
    assert f"gpufleet.{RENAMED}=" in label and f"gpufleet.{SERVICE}=" not in label, label
    state = sh(
        fleet, host, f"systemctl is-enabled {SERVICE} {RENAMED}; systemctl is-active {SERVICE} {RENAMED}; true"
    ).split()
    assert state == ["disabled", "enabled", "inactive", "active"], state
    journal = sh(fleet, host, f"journalctl -u {SERVICE} -u {RENAMED} --since @{int(booted_at)} -o cat --no-pager")
    assert "already in use" not in journal and "already allocated" not in journal, journal[-3000:]
    # No failure mark (a port conflict would be one): the ledger the rename took over holds it pending.
    doc = json.loads(read(fleet, host, f"{STATE_DIR}/{RENAMED}.json"))
    assert doc["failed"] == before["failed"] and doc["pending"]["service"] == RENAMED, doc

    out = deploy(pyinfra, inventory(**settings, vllm_service=RENAMED)).stdout  # settles it: verified and committed
    assert f"committed {settings['gpufleet_image_ref']}" in out, out[-4000:]
    doc = json.loads(read(fleet, host, f"{STATE_DIR}/{RENAMED}.json"))
    assert doc["committed"]["service"] == RENAMED and doc["pending"] is None and doc["failed"] == before["failed"]
    assert sh(fleet, host, f"ls {STATE_FILE} {UNIT} 2>/dev/null || true") == ""
    assert len(container_ids(fleet, host)) == 1
    out = deploy(pyinfra, inventory(**settings, vllm_service=RENAMED)).stdout
    assert changes(out) == 0, changed_ops(out)
