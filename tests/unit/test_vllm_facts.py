"""The one-command host snapshot: its parser on output shaped like a real host's, built from recorded nvidia-smi."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import socketserver
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from pyinfra.api.exceptions import FactProcessError

from gpufleet.facts.gpu_health import QUERY_HEALTH
from gpufleet.facts.nvidia import GPU_FIELDS, NvidiaVersion
from gpufleet.hoststate.sections import MARK, split
from gpufleet.vllm import facts as host_fact
from gpufleet.vllm import host_command
from gpufleet.vllm.facts import GpufleetHost, HostSnapshot, ServiceUnit, parse_snapshot
from gpufleet.vllm.host_command import DRIVER_FILE, PACKAGES, Paths, snapshot_command
from gpufleet.vllm.operations.image import image_present
from tests.ports import free_port

NV = Path(__file__).parent.parent / "fixtures" / "nvidia-smi"
DOCKER_API = Path(__file__).parent.parent / "fixtures" / "docker-api"
PATHS = Paths(
    service="vllm-qwen35",
    models_dir="/srv/vllm/models",
    model_dir="/srv/vllm/models/qwen3.5-awq",
    dirs=("/var/cache/vllm/qwen35/vllm", "/srv/vllm/models"),
    files=("/etc/a", "/etc/b"),
    ledger_path="/var/lib/gpufleet/vllm-qwen35.json",
    env_file="/etc/gpufleet/vllm-qwen35.env",
    port=5000,
    nvidia_key_url="http://repo/gpgkey",
    docker_repo_url=None,
    nvidia_keyring="/nonexistent/nvidia.gpg",
    docker_keyring="/nonexistent/docker.asc",  # missing: fetched
    nvidia_version_file="/var/lib/gpufleet/nvidia-version",
)


def fixture(kind: str, name: str) -> list[str]:
    text = (NV / kind / name).read_text()
    rc = next((line[3:] for line in text.splitlines() if line.startswith("rc=")), "0")
    return [line for line in text.splitlines() if not line.startswith("rc=")] + [f"@@rc {rc}"]


def output(**sections: list[str]) -> list[str]:
    """The snapshot's output: the service's answers (health, then cache_config) last, as the command prints them."""
    last = [name for name in ("health", "cache_config") if name in sections]
    lines: list[str] = []
    for name in [*(n for n in sections if n not in last), *last]:
        lines += ["", MARK + name, *sections[name]]
    return lines + ["", MARK + "end"]


def step(paths: Paths, function: str) -> str:
    """The snapshot's script running only `begin` and the call of `function`: one section on its own."""
    calls = host_command.steps(paths)
    return host_command.script([calls[0], next(call for call in calls if call.split()[0] == function)])


def function_body(name: str) -> str:
    """A function's text in the snapshot's script."""
    return host_command.SCRIPT.split(f"\n{name}() {{\n", 1)[1].split("\n}\n", 1)[0]


def code_lines(command: str) -> list[str]:
    return [line for line in command.splitlines() if not line.lstrip().startswith("#")]


def healthy(kind: str = "h200-2gpu", **over: list[str]) -> list[str]:
    base = {
        "os": [
            'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"',
            "ID=debian",
            'VERSION_ID="12"',
            "VERSION_CODENAME=bookworm",
        ],
        "arch": ["amd64"],
        "nvidia_smi": ["1"],
        "gpus": fixture(kind, "query-gpu.csv"),
        "driver": fixture(kind, "version.txt"),
        "daemon_json": ['{"insecure-registries": ["10.0.0.1:5000"], "runtimes": {"nvidia": {"path": "x"}}}'],
        "free": ["docker /var/lib/docker 104857600", "models /srv 52428800"],
        "packages": ["docker.io ii 20.10.24", "nvidia-container-toolkit ii 1.17.8-1", "docker-ce un <none>"],
        "files": ["a" * 64 + "  /etc/a"],
        "state": ["@@present", json.dumps({"current": {"image": "img:tag", "ref": "img@sha256:" + "0" * 64}})],
        "docker_images": [
            json.dumps(
                [
                    {"RepoTags": ["img:tag"], "RepoDigests": ["img@sha256:" + "0" * 64]},
                    {"RepoTags": ["other:latest"], "RepoDigests": []},
                ]
            )
        ],
        "model": [
            "config.json 120",
            "tokenizer.json 4000",
            "model-00001-of-00002.safetensors 10",
            "model-00002-of-00002.safetensors 10",
            "model.safetensors.index.json 300",
            "shard model-00001-of-00002.safetensors",
            "shard model-00002-of-00002.safetensors",
        ],
        "dirs": ["root root 755 /var/cache/vllm/qwen35/vllm"],
        "units": [
            "Id=docker.service",
            "ActiveState=active",
            "UnitFileState=enabled",
            "",
            "Id=vllm-qwen35.service",
            "ActiveState=active",
            "UnitFileState=enabled",
        ],
        "health": ["200", json.dumps({"object": "list", "data": [{"id": "qwen3.5-awq", "max_model_len": 32768}]})],
        "cache_config": ['vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0"} 1.0'],
    }
    base.update(over)
    return output(**base)


def test_parses_every_section():
    snap = GpufleetHost().process(healthy())
    assert snap.os["ID"] == "debian" and snap.arch == "amd64"
    assert len(snap.gpus) == 2 and snap.driver.cuda_version == "13.0"
    assert snap.nvidia_runtime and snap.daemon_json["insecure-registries"] == ["10.0.0.1:5000"]
    assert snap.free_kib == {"docker": 104857600, "models": 52428800} and snap.free_path["models"] == "/srv"
    assert snap.installed("docker.io") and not snap.installed("docker-ce")
    assert snap.file_sha256 == {"/etc/a": "a" * 64} and snap.file_sha256.get("/etc/b") is None
    assert snap.has_image_digest("img@sha256:" + "0" * 64) and not snap.has_image_digest("img@sha256:" + "1" * 64)
    assert snap.model_shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert snap.dirs.get("/srv/vllm/models") is None and snap.dirs["/var/cache/vllm/qwen35/vllm"] == (
        "root",
        "root",
        "755",
    )
    assert snap.unit_active("vllm-qwen35.service") and snap.unit_enabled("docker.service")
    assert snap.health_code == "200" and snap.served_models == [("qwen3.5-awq", 32768)]
    assert snap.cache_config == {"block_size": "16", "enable_prefix_caching": "True"}


def test_the_gpus_health_is_read_beside_them_and_only_where_nvidia_smi_listed_gpus():
    xid = "1 2026-12-03T09:30:00,000000+00:00 NVRM: Xid (PCI:0000:00:06): 79, GPU has fallen off the bus."
    snap = parse_snapshot(healthy(gpu_health=fixture("h200-health", "query-gpu-health.csv"), kernel_log=[xid]))
    health = snap.gpu_health
    assert health is not None and health.error is None and health.gpus[0].bus_id == "00000000:00:06.0"
    assert [(e.code, e.bus) for e in health.events] == [(79, (0, 0, 6))]
    no_gpu = healthy(gpus=["No devices were found", "@@rc 6"], gpu_health=[], kernel_log=[])
    assert parse_snapshot(no_gpu).gpu_health is None
    assert parse_snapshot(healthy()).gpu_health is None  # not read (a snapshot without the sections)


def test_a_server_without_cache_config_info_reports_none():
    snap = parse_snapshot(healthy(cache_config=[]))
    assert snap.cache_config == {} and snap.served_models == [("qwen3.5-awq", 32768)]


def test_a_wedged_nvidia_smi_is_a_problem_with_its_bound_not_a_hang():
    # `timeout` cut nvidia-smi off (exit 124); the command skipped the driver query after it.
    snap = parse_snapshot(healthy(gpus=["@@rc 124"], driver=[]))
    assert snap.gpus == [] and snap.nvidia_error == "nvidia-smi did not answer within 20 s (a wedged driver or GPU)"


def test_every_program_that_can_hang_runs_under_timeout():
    command = snapshot_command(dataclasses.replace(PATHS, site_cache_storage="/srv/cache"))
    programs = ("nvidia-smi --", "docker images", "docker ps", "df -Pk", "du -sk", "systemctl show", "dmesg --time")
    for line in code_lines(command):
        if not line.startswith(("read_gpus ", "read_driver ")):  # their query runs in ask_nvidia, under $t
            for program in programs:
                assert line.count(program) == line.count(f"$t {program}"), line
    assert [line.split()[0] for line in command.splitlines() if "nvidia-smi --" in line and "$t" not in line] == [
        "read_gpus",
        "read_driver",
    ]
    assert 'g=$($t "$@" 2>&1)' in function_body("ask_nvidia") and "begin @@gpufleet: 20 " in command
    assert 't="timeout -k 2 $timeout_s"' in function_body("begin")
    # curl bounds itself: every request (each --next starts one) has its own --max-time, the key requests put
    # before the others by `set --` included.
    reads = " ".join(function_body("http_reads").split("\\\n"))
    keys = re.findall(r'set -- (.*?) --next "\$@"', reads)
    requests = [*keys, *reads.split('curl "$@"', 1)[1].split("--next")]
    # the two keys, docker's images and containers, health, models, metrics
    assert len(keys) == 2 and len(requests) == 7 and all("--max-time" in r for r in requests), requests
    assert sum('--unix-socket "$socket"' in r for r in requests) == 2
    assert "--max-time" in function_body("find_container")


def test_the_docker_cli_runs_only_on_a_host_without_curl():
    # It costs more CPU than all the rest of the snapshot but nvidia-smi: docker's API answers through curl.
    for line in code_lines(snapshot_command(PATHS)):
        if "docker images" in line or "docker ps" in line:
            assert "no_curl && $t docker" in line, line
    assert function_body("no_curl").strip() == "! command -v curl >/dev/null && command -v docker >/dev/null"


def test_daemon_json_without_final_newline_keeps_the_next_section():
    # `printf '\n@@...'` puts each marker on its own line even after a file that ends without a newline.
    snap = parse_snapshot(healthy(daemon_json=['{"a": 1}'], free=["docker / 10", "models / 20"]))
    assert snap.daemon_json == {"a": 1} and snap.free_kib["models"] == 20


def test_units_not_installed():
    snap = parse_snapshot(
        healthy(
            units=[
                "Id=docker.service",
                "ActiveState=inactive",
                "UnitFileState=",
                "",
                "Id=vllm-qwen35.service",
                "ActiveState=inactive",
                "UnitFileState=",
            ],
            health=["000", ""],
        )
    )
    assert not snap.unit_active("docker.service") and not snap.unit_enabled("vllm-qwen35.service")
    assert snap.health_code is None and snap.served_models is None


def test_bare_host_without_nvidia_smi():
    snap = parse_snapshot(
        healthy(nvidia_smi=["0"], gpus=[], driver=[], daemon_json=[], state=[], docker_images=[], model=[], health=[])
    )
    assert snap.gpus == [] and snap.driver is None and snap.nvidia_error is None
    assert snap.daemon_json is None and snap.ledger_text is None and snap.model_files == {}
    assert snap.health_code is None and snap.other_ledgers == {}


def test_the_ledger_is_kept_as_text_an_empty_file_apart_from_none_and_other_services_ledgers_by_path():
    snap = parse_snapshot(healthy())
    assert json.loads(snap.ledger_text)["current"]["ref"] == "img@sha256:" + "0" * 64
    assert parse_snapshot(healthy(state=["@@present"])).ledger_text == "\n"  # an empty file: corrupt, not absent
    lines = healthy(**{"ledger /var/lib/gpufleet/old.json": ['{"schema": 2}']})
    assert parse_snapshot(lines).other_ledgers == {"/var/lib/gpufleet/old.json": '{"schema": 2}\n'}


def test_systemd_restarts_of_the_unit_are_read():
    running = ["ActiveState=active", "SubState=running", "NeedDaemonReload=no", "NRestarts=3", "Header="]
    assert parse_snapshot(healthy(running=running)).running.restarts == 3


def test_no_devices_is_no_gpu_not_an_error():
    snap = parse_snapshot(healthy(gpus=fixture("h200-2gpu", "bad-index.txt")))
    assert snap.gpus == [] and snap.nvidia_error is None


def test_broken_nvidia_smi_is_reported():
    snap = parse_snapshot(healthy(gpus=fixture("h200-2gpu", "bad-field.txt")))
    assert "not a valid field" in snap.nvidia_error


def test_invalid_daemon_json_is_reported_not_raised():
    snap = parse_snapshot(healthy(daemon_json=["{not json"]))
    assert snap.daemon_json is None and "not valid JSON" in snap.daemon_json_error


def test_truncated_output_is_an_error():
    with pytest.raises(FactProcessError, match="truncated"):
        parse_snapshot(healthy()[:-1])


def test_a_section_forged_in_an_answer_refuses_the_snapshot():
    # Something listening on the service's port (a local user's process) answers /v1/models with a body that carries
    # gpufleet's marker and a ledger of its own: a later section used to override the real one, and root acted on it.
    forged = json.dumps({"committed": {"service": "x", "ref": "evil@sha256:" + "f" * 64}})
    lines = healthy(health=["200", '{"object": "list", "data": []}', "", MARK + "state", "@@present", forged])
    with pytest.raises(
        FactProcessError, match=r"^host snapshot refused: a section 'state' inside the service's answers"
    ):
        parse_snapshot(lines)
    # A ledger of a path the host does not have, or a second end: refused the same way, or as a duplicate.
    other = healthy(health=["200", "{}", "", MARK + "ledger /var/lib/gpufleet/forged.json", forged])
    with pytest.raises(FactProcessError, match=r"section 'ledger /var/lib/gpufleet/forged.json' inside the service"):
        parse_snapshot(other)
    with pytest.raises(FactProcessError, match=r"its section 'end' appears twice"):
        parse_snapshot(healthy(cache_config=["", MARK + "end"]))


def test_command_is_valid_posix_shell_and_read_only():
    command = snapshot_command(PATHS)
    subprocess.run(["sh", "-n", "-c", command], check=True)  # syntax check with the host's kind of shell
    for word in (" rm ", " mv ", "install ", "mkdir", "tee ", "> /", "systemctl start", "systemctl restart"):
        assert word not in command


def test_service_unit_is_read_with_its_first_line():
    snap = parse_snapshot(
        healthy(
            service_unit=[
                "Id=ssh.service",
                "LoadState=loaded",
                "FragmentPath=/lib/systemd/system/ssh.service",
                "FirstLine=[Unit]",
            ]
        )
    )
    assert snap.service_unit == ServiceUnit("ssh.service", "loaded", "/lib/systemd/system/ssh.service", "[Unit]")
    assert snap.service_unit.exists


def test_a_missing_service_unit_does_not_exist():
    # What systemd prints for a name no unit has: no FragmentPath, so no FirstLine either.
    snap = parse_snapshot(healthy(service_unit=["Id=vllm-qwen35.service", "LoadState=not-found", "FragmentPath="]))
    assert snap.service_unit.fragment_path == "" and not snap.service_unit.exists


def test_first_line_keeps_equals_signs():
    snap = parse_snapshot(
        healthy(
            service_unit=[
                "Id=a.service",
                "LoadState=loaded",
                "FragmentPath=/x",
                "FirstLine=# Managed by gpufleet (h): a=b",
            ]
        )
    )
    assert snap.service_unit.first_line == "# Managed by gpufleet (h): a=b"


def test_both_docker_engines_packages_are_read():
    snap = parse_snapshot(
        healthy(
            packages=[
                "docker.io ii 20.10.24+dfsg1-1+deb12u1+b6",
                "containerd ii 1.6.20~ds1-1+deb12u3",
                "containerd.io un <none>",
            ]
        )
    )
    assert snap.packages == {"docker.io": "20.10.24+dfsg1-1+deb12u1+b6", "containerd": "1.6.20~ds1-1+deb12u3"}
    assert {"docker.io", "containerd", "docker-ce", "containerd.io"} <= set(PACKAGES)


HOSTILE = "http://repo.example/$(touch {marker})`touch {marker}`;touch {marker}&touch {marker}|touch {marker}'\""


def test_hostile_repo_urls_reach_curl_whole_and_never_the_shell(tmp_path):
    """Every line of the snapshot that names a repo URL, run by a real shell with curl recording its argv: the URL
    arrives as one word, exactly, and none of the shell syntax in it runs."""
    marker = tmp_path / "injected"
    hostile = HOSTILE.format(marker=marker)
    paths = dataclasses.replace(PATHS, nvidia_key_url=f"{hostile}/gpgkey", docker_repo_url=hostile)
    lines = [line for line in snapshot_command(paths).splitlines() if "repo.example" in line]
    assert [line.split()[0] for line in lines] == ["read_http"]  # one curl for both keys (and the service's own)
    argv_log = tmp_path / "argv"
    record = f'curl() {{ for a in "$@"; do printf \'%s\\n\' "$a"; done >> {argv_log}; }}'
    subprocess.run(["sh", "-c", f"{record}\n{step(paths, 'read_http')}"], check=False, capture_output=True, timeout=10)
    os_id = next(
        line.split("=", 1)[1].strip('"')
        for line in Path("/etc/os-release").read_text().splitlines()
        if line.startswith("ID=")
    )
    words = argv_log.read_text().splitlines() if argv_log.exists() else []
    assert f"{hostile}/gpgkey" in words and f"{hostile}/{os_id}/gpg" in words
    assert not marker.exists()


@pytest.mark.parametrize("hang", ["sleep 60", "trap '' TERM; sleep 60"], ids=["stops-on-term", "ignores-term"])
def test_a_hanging_nvidia_smi_is_cut_off_by_the_snapshot_itself(tmp_path, monkeypatch, hang):
    # The real command, run here: a stand-in nvidia-smi that never answers, and a 1 s bound. One stuck in the
    # kernel ignores SIGTERM: `timeout -k 2` kills it and exits 137, not 124; that is the same finding.
    monkeypatch.setattr(host_command, "COMMAND_TIMEOUT_S", 1)
    monkeypatch.setattr(host_fact, "COMMAND_TIMEOUT_S", 1)  # the bound the finding names
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\n{hang}\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/sbin:/usr/bin:/sbin:/bin"}
    start = time.monotonic()
    out = subprocess.run(["sh", "-c", snapshot_command(PATHS)], env=env, capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - start
    snap = parse_snapshot(out.stdout.splitlines())
    # One bound, not two: the driver query is skipped once the GPU query timed out.
    assert snap.nvidia_error == "nvidia-smi did not answer within 1 s (a wedged driver or GPU)" and elapsed < 10


KEY = "-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nmQINBF\n=abcd\n-----END PGP PUBLIC KEY BLOCK-----"


class _Repo(BaseHTTPRequestHandler):
    """The repos' keys and a vLLM server's /health, /v1/models and /metrics, on one loopback port."""

    seen: ClassVar[list[tuple[str, str | None]]] = []
    health = 200

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        bodies = {
            "/gpgkey": KEY,
            "/health": "",
            "/v1/models": json.dumps({"object": "list", "data": [{"id": "qwen3.5-awq", "max_model_len": 32768}]}),
            "/metrics": '# HELP x\nvllm:num_requests_running{engine="0"} 0.0\n'
            'vllm:cache_config_info{block_size="16",engine="0"} 1.0\nvllm:other 2\n',
        }
        body = KEY if self.path.endswith("/gpg") else bodies.get(self.path)
        code = self.health if self.path == "/health" else 200 if body is not None else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write((body or "").encode())

    def log_message(self, *args: object) -> None:
        pass


# What the line before the snapshot's HTTP line leaves from docker's API: the labelled container that runs, with its
# own address (the server is read there; here the test's server on the loopback), or none.
RUNNING_CONTAINER = (
    'cj=\'[{"Id":"c0ffee","NetworkSettings":{"Networks":{"bridge":{"IPAddress":"127.0.0.1"}}}}]\'; cip=127.0.0.1'
)


@pytest.mark.parametrize("health", [200, 503])
def test_one_curl_reads_the_keys_and_the_server_and_only_v1_models_gets_the_api_key(tmp_path, health):
    """The snapshot's HTTP line, run by a real shell and curl against a real local server."""
    _Repo.seen, _Repo.health = [], health
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Repo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        env_file = tmp_path / "vllm.env"
        env_file.write_text("VLLM_API_KEY=sekrit-123\n")
        paths = dataclasses.replace(
            PATHS,
            port=port,
            env_file=str(env_file),
            nvidia_key_url=f"http://127.0.0.1:{port}/gpgkey",
            docker_repo_url=f"http://127.0.0.1:{port}/linux",
        )
        line = step(paths, "read_http")
        out = subprocess.run(
            ["sh", "-c", f"{RUNNING_CONTAINER}\n{line}\nprintf '\\n{MARK}end\\n'"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.shutdown()
    snap = parse_snapshot(out.stdout.splitlines())
    assert snap.nvidia_key == KEY + "\n" and snap.docker_key == KEY + "\n"
    assert snap.health_code == str(health)
    if health == 200:
        assert snap.served_models == [("qwen3.5-awq", 32768)]
        assert snap.cache_config["block_size"] == "16"
    assert "vllm:other" not in out.stdout and "num_requests_running" not in out.stdout  # awk kept only cache config
    assert {path for path, auth in _Repo.seen if auth} == {"/v1/models"}
    assert ("/v1/models", "Bearer sekrit-123") in _Repo.seen
    assert "sekrit" not in line


# --- docker: the Engine API on its socket, through the one curl ---------------------------------------------------
LABEL = "gpufleet.vllm-qwen35"


def recorded(name: str) -> list[str]:
    return (DOCKER_API / name).read_text().splitlines()


def from_api(images: str = "[]\n", containers: str = "[]\n", label: str = LABEL) -> list[str]:
    return healthy(docker_images=images.splitlines(), **{f"docker_containers {label}": containers.splitlines()})


def from_cli(images: list[str], containers: list[str]) -> list[str]:
    """What the docker CLI printed for the same engine at the same moment (the snapshot's fallback without curl)."""
    return healthy(docker_images=[], images=images, running=containers)


@pytest.mark.parametrize("recording", sorted(p.name.removesuffix(".json") for p in DOCKER_API.glob("*images*.json")))
def test_images_from_the_api_are_the_rows_docker_images_prints(recording):
    api = parse_snapshot(healthy(docker_images=recorded(f"{recording}.json"))).images
    cli = parse_snapshot(from_cli(recorded(f"{recording}.cli.txt"), [])).images
    assert sorted(api) == sorted(cli) and len(api) == len(set(api))


@pytest.mark.parametrize(
    "recording", sorted(p.name.removesuffix(".json") for p in DOCKER_API.glob("*containers*.json"))
)
def test_containers_from_the_api_are_what_docker_ps_prints(recording):
    api = parse_snapshot(healthy(**{f"docker_containers {LABEL}": recorded(f"{recording}.json")})).running
    cli = parse_snapshot(from_cli([], recorded(f"{recording}.cli.txt"))).running
    assert api.containers == cli.containers


def test_the_recorded_converged_host_runs_what_its_unit_pins():
    snap = parse_snapshot(
        from_api(
            (DOCKER_API / "api1.41-images.json").read_text(),
            (DOCKER_API / "api1.41-containers-labelled.json").read_text(),
        )
    )
    ref = "10.213.0.1:5000/vllm/vllm-openai@sha256:5afcd0f2c8578993dfda065fd4e60be972ded12cf57d780949f677b04473dadc"
    assert snap.running.containers == (("21b31c1165baae9c", ref),)
    assert snap.running.running_image == ref and snap.running.running_spec_hash == "21b31c1165baae9c"
    assert snap.has_image_digest(ref) and image_present(snap.images, ref)


def test_the_recorded_hand_started_container_is_drift_and_the_stopped_one_is_not_listed():
    pinned = "10.213.19.1:5000/vllm/vllm-openai@sha256:d28ceff4b10e0a2b93abf6f09c848f61da1d7cb89419d7aa59aeeb42f52d08c6"
    running = [
        "ActiveState=active",
        "NeedDaemonReload=no",
        f"Header=# Spec d55964a1c154b307; image pinned to {pinned}.",
    ]
    lines = healthy(running=running, **{f"docker_containers {LABEL}": recorded("api1.41-containers-two.json")})
    snap = parse_snapshot(lines).running
    assert snap.containers == (("handmade", "10.213.19.1:5000/vllm/vllm-openai:nightly"), ("d55964a1c154b307", pinned))
    assert snap.drift() == [
        "the container runs spec handmade, the unit spec d55964a1c154b307",
        f"the container runs 10.213.19.1:5000/vllm/vllm-openai:nightly, the unit pins {pinned}",
        "2 containers carry the service's label",
    ]
    images = parse_snapshot(healthy(docker_images=recorded("api1.41-images-mixed.json"))).images
    assert image_present(images, pinned) and image_present(
        images,
        "10.213.19.1:5000/vllm/vllm-openai@sha256:03ff8b703ec099371e1bce2bfc2f247de24bd99aa62c6cf2fc99c8ffa4805237",
    )
    assert not any(repo in ("gpufleet/local", "ubuntu", "<none>") for repo, _, _ in images)


def test_a_docker_daemon_that_is_down_lists_nothing():
    # curl still prints each marker after a request that could not connect: the sections are there, empty.
    snap = parse_snapshot(from_api(images="", containers=""))
    assert snap.images == [] and snap.running.containers == () and snap.running.running_image is None
    # an error answer (curl -f prints none) or an answer cut off by --max-time: no listing either
    assert parse_snapshot(from_api(images='[{"RepoTags": ["a:b"], "RepoDi')).images == []


def test_an_image_is_listed_once_per_tag_of_its_digest_and_digest_only_pulls_as_none():
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    images = json.dumps(
        [
            {
                "RepoTags": ["reg:5000/v/vllm:nightly", "reg:5000/v/vllm:latest", "mirror/vllm:x"],
                "RepoDigests": ["reg:5000/v/vllm@" + d1],
            },
            {"RepoTags": None, "RepoDigests": ["vllm/vllm-openai@" + d2]},  # pulled by digest only
            {"RepoTags": ["built:here"], "RepoDigests": []},  # no registry digest: never a pin
            {"RepoTags": ["<none>:<none>"], "RepoDigests": ["<none>@<none>"]},  # dangling, as old engines list it
        ]
    )
    assert sorted(parse_snapshot(from_api(images)).images) == [
        ("reg:5000/v/vllm", "latest", d1),
        ("reg:5000/v/vllm", "nightly", d1),
        ("vllm/vllm-openai", "<none>", d2),
    ]


def test_a_container_from_another_image_or_a_second_container_is_drift():
    def container(image: str, spec: str = "abc") -> dict[str, object]:
        return {"Image": image, "Labels": {LABEL: spec, "other": "x"}, "State": "running"}

    pinned, other = "reg/v@sha256:" + "1" * 64, "reg/v:nightly"
    running = ["ActiveState=active", "NeedDaemonReload=no", f"Header=# Spec abc; image pinned to {pinned}."]
    lines = healthy(running=running, **{f"docker_containers {LABEL}": [json.dumps([container(other)])]})
    assert parse_snapshot(lines).running.drift() == [f"the container runs {other}, the unit pins {pinned}"]
    lines = healthy(running=running, **{f"docker_containers {LABEL}": [json.dumps([container(pinned)] * 2)]})
    two = parse_snapshot(lines).running
    assert two.containers == (("abc", pinned), ("abc", pinned)) and two.running_image is None
    assert two.drift() == ["2 containers carry the service's label"]
    # The label filter lets only labelled containers through; one without the label would read "", as in docker ps.
    unlabelled = {"Image": pinned, "Labels": {}}
    assert parse_snapshot(from_api(containers=json.dumps([unlabelled]))).running.containers == (("", pinned),)


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class _Docker(BaseHTTPRequestHandler):
    """dockerd's answers to the snapshot's two listings, on a unix socket, from the recordings."""

    seen: ClassVar[list[str]] = []
    hang = False

    def do_GET(self) -> None:
        self.seen.append(self.path)
        if self.hang:
            time.sleep(5)
        name = "api1.41-images.json" if self.path == "/images/json" else "api1.41-containers-labelled.json"
        body = (DOCKER_API / name).read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:
        return "unix"

    def log_message(self, *args: object) -> None:
        pass


def _curl_line(monkeypatch, socket: Path) -> str:
    monkeypatch.setattr(host_command, "DOCKER_SOCKET", str(socket))
    paths = dataclasses.replace(PATHS, nvidia_key_url="http://127.0.0.1:9/gpgkey", port=9)  # nothing listens
    return step(paths, "read_http")


def _run(line: str) -> HostSnapshot:
    out = subprocess.run(["sh", "-c", f"{line}\nprintf '\\n{MARK}end\\n'"], capture_output=True, text=True, timeout=60)
    return parse_snapshot(out.stdout.splitlines())


@pytest.mark.parametrize("hang", [False, True], ids=["answers", "hangs"])
def test_one_curl_reads_dockers_listings_from_its_socket(tmp_path, monkeypatch, hang):
    """The snapshot's HTTP line, run by a real shell and curl against a docker stand-in on a unix socket."""
    socket = tmp_path / "docker.sock"
    _Docker.seen, _Docker.hang = [], hang
    server = _UnixHTTPServer(str(socket), _Docker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if hang:
        monkeypatch.setattr(host_command, "COMMAND_TIMEOUT_S", 1)
    try:
        start = time.monotonic()
        snap = _run(_curl_line(monkeypatch, socket))
        elapsed = time.monotonic() - start
    finally:
        server.shutdown()
        server.server_close()
    assert _Docker.seen == [
        "/images/json",
        "/containers/json?filters=%7B%22label%22%3A%5B%22gpufleet.vllm-qwen35%22%5D%7D",
    ]
    if hang:  # each request bounded by its own --max-time: nothing listed, not a hung snapshot
        assert snap.images == [] and snap.running.containers == () and elapsed < 5
    else:
        assert snap.images == parse_snapshot(from_cli(recorded("api1.41-images.cli.txt"), [])).images
        assert snap.running.containers == (("21b31c1165baae9c", snap.images[0][0] + "@" + snap.images[0][2]),)


def test_no_docker_socket_is_no_images_and_no_containers(tmp_path, monkeypatch):
    snap = _run(_curl_line(monkeypatch, tmp_path / "absent.sock"))
    assert snap.images == [] and snap.running.containers == ()


def test_the_model_directory_is_read_with_one_find_and_one_awk(tmp_path):
    model = tmp_path / "m"
    (model / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (model / "sub").mkdir()
    index = {
        "weight_map": {
            "a": "model-00002-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors",
        }
    }
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    (model / "config.json").write_text("{}")
    (model / "name with space.bin").write_text("xx")
    (model / "sub" / "deeper.bin").write_text("x")
    (model / "top.incomplete").write_text("")  # not hf's: an ordinary file
    for i in range(5):
        (model / ".cache" / "huggingface" / "download" / f"f{i}.incomplete").write_text("")
    paths = dataclasses.replace(PATHS, model_dir=str(model))
    body = function_body("read_model")
    assert (
        body.count("find ") == 1
        and body.count("awk ") == 1
        and not any(word in body for word in ("grep", "sort", "head"))
    )
    snap = _run(step(paths, "read_model"))
    assert snap.model_files == {
        "model.safetensors.index.json": len(json.dumps(index)),
        "config.json": 2,
        "name with space.bin": 2,
        "top.incomplete": 0,
    }
    assert snap.model_shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert len(snap.model_incomplete) == 3
    assert all(p.startswith("./.cache/huggingface/download/f") for p in snap.model_incomplete)


@pytest.mark.parametrize(
    ("daemon_json", "measured"),
    [
        ('{"data-root": "%s"}', "data-root"),  # no final newline, as json.dump writes it
        ('{\n  "runtimes": {},\n  "data-root"  :  "%s"\n}\n', "data-root"),
        ('{"runtimes": {}}', "default"),
    ],
)
def test_docker_space_is_measured_at_data_root(tmp_path, monkeypatch, daemon_json, measured):
    root = tmp_path / "docker root"
    root.mkdir()
    config = tmp_path / "daemon.json"
    config.write_text(daemon_json % root if "%s" in daemon_json else daemon_json)
    monkeypatch.setattr(host_command, "DAEMON_JSON", str(config))
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    out = subprocess.run(["sh", "-c", snapshot_command(PATHS)], env=env, capture_output=True, text=True, timeout=60)
    snap = parse_snapshot(out.stdout.splitlines())
    assert snap.daemon_json == json.loads(config.read_text())
    expected = str(root) if measured == "data-root" else "/var/lib/docker"
    while not os.path.exists(expected):
        expected = os.path.dirname(expected)
    assert snap.free_path["docker"] == expected and snap.free_kib["docker"] > 0 and snap.free_kib["models"] > 0
    assert snap.os["ID"]


def test_the_whole_command_prints_each_section_once_in_order(tmp_path, monkeypatch):
    """The script names its sections itself: run whole here (a stand-in nvidia-smi, no Docker, nothing on the
    port), it prints each section the parser reads, once, in order."""
    fake_nvidia_smi(tmp_path, QUERY)
    monkeypatch.setattr(host_command, "DOCKER_SOCKET", str(tmp_path / "absent.sock"))
    (tmp_path / "state").mkdir()
    paths = dataclasses.replace(
        PATHS,
        nvidia_key_url="http://127.0.0.1:9/gpgkey",
        port=9,
        ledger_path=str(tmp_path / "state" / "vllm-qwen35.json"),
        site_cache_storage=str(tmp_path),
        group_head=("127.0.0.1", 9),
    )
    env = {"PATH": f"{tmp_path}:/usr/sbin:/usr/bin:/sbin:/bin"}
    out = subprocess.run(["sh", "-c", snapshot_command(paths)], env=env, capture_output=True, text=True, timeout=60)
    assert list(split(out.stdout.splitlines())) == [
        "os",
        "arch",
        "nvidia_smi",
        "gpus",
        "driver",
        "gpu_health",
        "kernel_log",
        "daemon_json",
        "free",
        "site_cache",
        "group_probe",
        "packages",
        "files",
        "state",
        "other_ledgers",
        "images",
        "model",
        "dirs",
        "units",
        "service_unit",
        "running",
        "nvidia_key",
        "docker_images",
        f"docker_containers {LABEL}",
        "health",
        "cache_config",
        "end",
    ]


# --- the driver's version file: one nvidia-smi call per snapshot while the driver stays -----------------------
VERSION = (NV / "h200-2gpu" / "version.txt").read_text()
OLD_VERSION = VERSION.replace("580.159.04", "535.104.05").replace("580.159", "535.104").replace("13.0", "12.2")


def test_the_driver_read_live_is_kept_as_the_version_files_content():
    snap = parse_snapshot(healthy())
    assert snap.driver == NvidiaVersion("580.159.04", "13.0") and not snap.driver_from_file
    assert snap.driver_output == VERSION


def test_the_driver_read_from_the_version_file_is_parsed_alike_and_marked():
    lines = healthy(driver=[])
    at = lines.index(MARK + "driver")
    lines[at : at + 1] = [MARK + DRIVER_FILE, *VERSION.splitlines()]
    snap = parse_snapshot(lines)
    assert snap.driver == NvidiaVersion("580.159.04", "13.0") and snap.driver_from_file
    assert snap.driver_output is None  # nothing to write: the file is what said it


def fake_nvidia_smi(tmp_path: Path, query: str, rc: int = 0) -> None:
    """A stand-in nvidia-smi that logs each call's first argument and answers the GPU query with `query` (exit rc) and
    --version with the recorded H200's answer."""
    (tmp_path / "query").write_text(query)
    (tmp_path / "version").write_text(VERSION)
    (tmp_path / "health").write_text(HEALTH)
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f'#!/bin/sh\necho "$1" >> {tmp_path}/calls\n'
        f"case $1 in --version) cat {tmp_path}/version;; {LIVE[2]}) cat {tmp_path}/health;; "
        f"*) cat {tmp_path}/query; exit {rc};; esac\n"
    )
    fake.chmod(0o755)
    dmesg = tmp_path / "dmesg"  # this machine's kernel log is no test host's
    dmesg.write_text("#!/bin/sh\necho '2026-12-03T09:00:00,000000+00:00 NVRM: Xid (PCI:0000:00:06): 13, x'\n")
    dmesg.chmod(0o755)


def snapshot_with(tmp_path: Path, version_file: str | None) -> tuple[HostSnapshot, list[str]]:
    """The real snapshot command in the local sh, the stand-in first on PATH; the nvidia-smi calls it made."""
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    paths = dataclasses.replace(
        PATHS, nvidia_version_file=version_file, nvidia_key_url="http://127.0.0.1:9/gpgkey", port=9
    )  # nothing listens: curl gives up at once
    env = {"PATH": f"{tmp_path}:/usr/sbin:/usr/bin:/sbin:/bin"}
    out = subprocess.run(["sh", "-c", snapshot_command(paths)], env=env, capture_output=True, text=True, timeout=60)
    return parse_snapshot(out.stdout.splitlines()), calls.read_text().split() if calls.exists() else []


QUERY = (NV / "h200-2gpu" / "query-gpu.csv").read_text()
HEALTH = (NV / "h200-health" / "query-gpu-health.csv").read_text()
# The stand-in logs each call's first argument: the GPU query, the driver's version, the health query.
LIVE = [f"--query-gpu={','.join(GPU_FIELDS)}", "--version", QUERY_HEALTH.split()[1]]


def test_a_version_file_naming_the_driver_spares_the_version_call(tmp_path):
    fake_nvidia_smi(tmp_path, QUERY)
    version_file = tmp_path / "nvidia-version"
    snap, calls = snapshot_with(tmp_path, str(version_file))  # no file yet: asked live
    assert calls == LIVE and snap.driver == NvidiaVersion("580.159.04", "13.0") and snap.driver_output == VERSION
    health = snap.gpu_health  # the health query and the kernel log, in the same command
    assert health is not None and health.error is None and [e.code for e in health.events] == [13]
    version_file.write_text(snap.driver_output)  # what the version_file operation writes
    snap, calls = snapshot_with(tmp_path, str(version_file))
    assert calls == [LIVE[0], LIVE[2]], calls
    assert snap.driver == NvidiaVersion("580.159.04", "13.0") and snap.driver_from_file and len(snap.gpus) == 2
    assert snap.nvidia_error is None and snap.driver_output is None


def test_a_version_file_of_another_driver_is_not_believed(tmp_path):
    # The driver was upgraded since the file was written: the CUDA version it names is the old driver's.
    fake_nvidia_smi(tmp_path, QUERY)
    (tmp_path / "nvidia-version").write_text(OLD_VERSION)
    snap, calls = snapshot_with(tmp_path, str(tmp_path / "nvidia-version"))
    assert calls == LIVE and snap.driver == NvidiaVersion("580.159.04", "13.0") and not snap.driver_from_file
    assert snap.driver_output == VERSION  # to be written
    # ... and the other way: a downgrade to a driver too old for the image shows its own CUDA version.
    fake_nvidia_smi(tmp_path, QUERY.replace("580.159.04", "535.104.05"))
    (tmp_path / "version").write_text(OLD_VERSION)
    (tmp_path / "nvidia-version").write_text(VERSION)
    snap, calls = snapshot_with(tmp_path, str(tmp_path / "nvidia-version"))
    assert calls == LIVE and snap.driver == NvidiaVersion("535.104.05", "12.2")


@pytest.mark.parametrize(
    "content",
    [
        None,  # no file
        "",
        VERSION.replace("CUDA Version        : 13.0\n", ""),  # cut short
        VERSION.replace(": 13.0", ": thirteen"),
        VERSION.replace("DRIVER version      : 580.159.04", "DRIVER version      : 580.159.041"),
        VERSION.replace("DRIVER", "driver"),
        VERSION + VERSION,  # two answers: not what nvidia-smi says
    ],
    ids=["missing", "empty", "no-cuda-line", "cuda-not-a-version", "longer-driver", "renamed-key", "twice"],
)
def test_a_missing_or_garbled_version_file_means_asking_nvidia_smi(tmp_path, content):
    fake_nvidia_smi(tmp_path, QUERY)
    if content is not None:
        (tmp_path / "nvidia-version").write_text(content)
    snap, calls = snapshot_with(tmp_path, str(tmp_path / "nvidia-version"))
    assert calls == LIVE and snap.driver == NvidiaVersion("580.159.04", "13.0") and snap.driver_output == VERSION


def test_no_version_file_setting_always_asks(tmp_path):
    fake_nvidia_smi(tmp_path, QUERY)
    (tmp_path / "nvidia-version").write_text(VERSION)
    assert snapshot_with(tmp_path, None)[1] == LIVE


def test_a_failing_gpu_query_is_reported_whatever_the_version_file_says(tmp_path):
    # A broken driver must surface: the file's driver is never taken for the GPU query's.
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"
    fake_nvidia_smi(tmp_path, failed, rc=9)
    (tmp_path / "nvidia-version").write_text(VERSION)
    snap, calls = snapshot_with(tmp_path, str(tmp_path / "nvidia-version"))
    assert calls == LIVE[:2] and "couldn't communicate with the NVIDIA driver" in snap.nvidia_error
    assert snap.driver is None and snap.driver_output is None and not snap.driver_from_file


def test_no_gpu_means_no_driver_to_record(tmp_path):
    fake_nvidia_smi(tmp_path, "No devices were found\n", rc=6)
    (tmp_path / "nvidia-version").write_text(VERSION)
    snap, calls = snapshot_with(tmp_path, str(tmp_path / "nvidia-version"))
    assert calls == LIVE[:2] and snap.gpus == [] and snap.nvidia_error is None and snap.driver_output is None


def test_the_version_file_is_read_with_shell_builtins_only():
    # No program, no subshell, no pipe: a hit costs the host nothing but the shell's own reads.
    reading = function_body("read_driver").split("\n  shift\n", 1)[0]
    assert 'done 2>/dev/null <"$1"' in reading
    assert not any(word in reading for word in ("cat ", "$(", "`", " | ", "grep", "sed"))


# --- repo keys: fetched only for a missing keyring, or with refresh_keys ------------------------------------------
def key_paths(tmp_path: Path, installed: set[str], refresh: bool = False) -> Paths:
    """PATHS with docker-ce, both keyrings under tmp_path (those named in `installed` exist), nothing listening."""
    keyrings = {name: tmp_path / f"{name}.keyring" for name in ("nvidia", "docker")}
    for name in installed:
        keyrings[name].write_text("an installed key")
    return dataclasses.replace(
        PATHS,
        nvidia_key_url="http://nv.example/gpgkey",
        docker_repo_url="http://docker.example/linux",
        nvidia_keyring=str(keyrings["nvidia"]),
        docker_keyring=str(keyrings["docker"]),
        refresh_keys=refresh,
        port=9,
    )


def curl_argv(paths: Paths, tmp_path: Path) -> list[str]:
    """The argv of the snapshot's one curl, run by the real shell (dash) with curl replaced by a recorder."""
    log = tmp_path / "argv"
    log.unlink(missing_ok=True)
    record = f'curl() {{ for a in "$@"; do printf \'%s\\0\' "$a"; done >> {log}; }}'
    line = step(paths, "read_http")
    subprocess.run(["sh", "-c", f"{record}\n{line}"], check=True, capture_output=True, timeout=10)
    return log.read_text().split("\0")[:-1]


OS_ID = next(
    line.split("=", 1)[1].strip('"')
    for line in Path("/etc/os-release").read_text().splitlines()
    if line.startswith("ID=")
)
NV_GET = ["-fsSL", "--max-time", "15", "http://nv.example/gpgkey", "-w"]
DOCKER_GET = ["-fsSL", "--max-time", "15", f"http://docker.example/linux/{OS_ID}/gpg", "-w"]


@pytest.mark.parametrize(
    ("installed", "refresh", "gets"),
    [
        ({"nvidia", "docker"}, False, []),  # a converged host: nothing leaves it
        ({"docker"}, False, [NV_GET + [f"\\n{MARK}docker_images\\n", "--next"]]),
        ({"nvidia"}, False, [DOCKER_GET + [f"\\n{MARK}docker_images\\n", "--next"]]),
        (
            set(),
            False,
            [NV_GET + [f"\\n{MARK}docker_key\\n", "--next"], DOCKER_GET + [f"\\n{MARK}docker_images\\n", "--next"]],
        ),
        (
            {"nvidia", "docker"},
            True,
            [NV_GET + [f"\\n{MARK}docker_key\\n", "--next"], DOCKER_GET + [f"\\n{MARK}docker_images\\n", "--next"]],
        ),
    ],
    ids=["both-installed", "nvidia-missing", "docker-missing", "both-missing", "refresh"],
)
def test_a_key_is_requested_only_for_a_missing_keyring_or_a_refresh(tmp_path, installed, refresh, gets):
    argv = curl_argv(key_paths(tmp_path, installed, refresh), tmp_path)
    expected_keys = [word for get in gets for word in get]
    assert argv[: len(expected_keys)] == expected_keys
    # then Docker's socket, the first request when no key is asked for (no --next before it)
    assert argv[len(expected_keys) : len(expected_keys) + 2] == ["-fs", "--max-time"]
    assert not any(word.endswith(("/gpgkey", "/gpg")) for word in argv[len(expected_keys) :])


def test_the_key_decision_starts_no_program(tmp_path):
    # `[ -f ]` and `set --` are builtins: a no-op host starts curl and nothing else for it (`command -v` is one too).
    keys = function_body("http_reads").split('curl "$@"', 1)[0]
    assert keys.count("[ ! -f ") == 2 and "$(" not in keys and "|" not in keys.replace("||", ""), keys


@pytest.mark.parametrize(
    ("installed", "refresh"),
    [
        ({"nvidia", "docker"}, False),
        ({"docker"}, False),
        ({"nvidia"}, False),
        (set(), False),
        ({"nvidia", "docker"}, True),
    ],
    ids=["both-installed", "nvidia-missing", "docker-missing", "both-missing", "refresh"],
)
def test_every_section_keeps_its_marker_whichever_keys_are_fetched(tmp_path, monkeypatch, installed, refresh):
    """The HTTP line with real curl against the key server, Docker's socket and the service: the keys asked for
    land in their sections, the others are None, and the sections after them parse as always."""
    socket = tmp_path / "docker.sock"
    _Docker.seen, _Docker.hang = [], False
    _Repo.seen, _Repo.health = [], 200
    docker = _UnixHTTPServer(str(socket), _Docker)
    web = ThreadingHTTPServer(("127.0.0.1", free_port()), _Repo)
    for server in (docker, web):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(host_command, "DOCKER_SOCKET", str(socket))
    try:
        port = web.server_address[1]
        paths = dataclasses.replace(
            key_paths(tmp_path, installed, refresh),
            port=port,
            nvidia_key_url=f"http://127.0.0.1:{port}/gpgkey",
            docker_repo_url=f"http://127.0.0.1:{port}/linux",
        )
        snap = _run(step(paths, "read_http"))
    finally:
        for server in (docker, web):
            server.shutdown()
            server.server_close()
    fetched = {"nvidia", "docker"} if refresh else {"nvidia", "docker"} - installed
    assert snap.nvidia_key == (KEY + "\n" if "nvidia" in fetched else None)
    assert snap.docker_key == (KEY + "\n" if "docker" in fetched else None)
    key_paths_asked = {"nvidia": "/gpgkey", "docker": f"/linux/{OS_ID}/gpg"}
    assert {path for path, _ in _Repo.seen} == {key_paths_asked[name] for name in fetched} | {
        "/health",
        "/v1/models",
        "/metrics",
    }
    assert snap.images == parse_snapshot(from_cli(recorded("api1.41-images.cli.txt"), [])).images
    assert snap.health_code == "200" and snap.served_models == [("qwen3.5-awq", 32768)]
    assert snap.cache_config["block_size"] == "16"


@pytest.mark.parametrize("installed", [{"nvidia", "docker"}, set()], ids=["installed", "missing"])
def test_a_key_server_that_is_down_leaves_the_keys_none_and_the_rest_intact(tmp_path, monkeypatch, installed):
    monkeypatch.setattr(host_command, "DOCKER_SOCKET", str(tmp_path / "absent.sock"))
    paths = dataclasses.replace(
        key_paths(tmp_path, installed, refresh=True),
        nvidia_key_url="http://127.0.0.1:9/gpgkey",
        docker_repo_url="http://127.0.0.1:9/linux",
    )
    snap = _run(step(paths, "read_http"))
    assert snap.nvidia_key is None and snap.docker_key is None and snap.images == [] and snap.health_code is None


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:5000/"),
        ("10.0.0.12", "http://10.0.0.12:5000/"),
        ("fd00::12", "http://[fd00::12]:5000/"),
    ],
)
def test_the_snapshot_asks_the_server_where_the_port_is_published(address, url):
    """Without a container address of its own (host networking), where the port is published."""
    line = step(dataclasses.replace(PATHS, port=5000, address=address), "read_http")
    record = 'curl() { for a in "$@"; do printf \'%s\\n\' "$a"; done; }'
    argv = subprocess.run(
        ["sh", "-c", f"{record}\ncj=; cip=\n{line}"], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()
    assert all(f"{url}{path}" in argv for path in ("health", "v1/models", "metrics")), argv


def test_the_key_goes_only_to_a_running_labelled_container_at_its_own_address(tmp_path):
    """A local user's listener on the published port (nothing of ours runs) gets no key; a running container is
    read at its own address, never at the port."""
    env_file = tmp_path / "vllm.env"
    env_file.write_text("VLLM_API_KEY=sekrit-123\n")
    line = step(dataclasses.replace(PATHS, port=5000, env_file=str(env_file)), "read_http")
    # curl records its argv and what it reads on stdin (the header -H @- takes).
    record = "curl() { for a in \"$@\"; do printf 'arg %s\\n' \"$a\"; done; sed 's/^/stdin /'; }"
    seen = {}
    for case, known in (
        ("none running", "cj='[]'; cip="),
        ("running", 'cj=\'[{"Id":"c0","IPAddress":"172.17.0.9"}]\'; cip=172.17.0.9'),
    ):
        seen[case] = subprocess.run(
            ["sh", "-c", f"{record}\n{known}\n{line}"], capture_output=True, text=True, timeout=30
        ).stdout
    assert "sekrit" not in seen["none running"] and "arg http://127.0.0.1:5000/v1/models" in seen["none running"]
    assert "stdin Authorization: Bearer sekrit-123" in seen["running"]
    assert "arg http://172.17.0.9:5000/v1/models" in seen["running"] and "127.0.0.1:5000" not in seen["running"]


def test_the_container_address_comes_from_dockers_listing():
    """The line before the HTTP line, on what docker's API answers (the shape of a real /containers/json)."""
    lookup = step(PATHS, "find_container")
    listing = (
        '[{"Id":"4f2a","Names":["/x"],"Ports":[{"IP":"0.0.0.0","PrivatePort":5000,"PublicPort":5000}],'
        '"NetworkSettings":{"Networks":{"bridge":{"IPAMConfig":null,"Gateway":"172.17.0.1",'
        '"IPAddress":"172.17.0.3","IPPrefixLen":16}}}}]'
    )
    fake = f"curl() {{ printf '%s' {shlex.quote(listing)}; }}"
    out = subprocess.run(
        ["sh", "-c", f'{fake}\n{lookup}\necho "$cip"'], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    assert out == "172.17.0.3"
    host_network = listing.replace(
        '"bridge":{"IPAMConfig":null,"Gateway":"172.17.0.1","IPAddress":"172.17.0.3"',
        '"host":{"IPAMConfig":null,"Gateway":"","IPAddress":""',
    )
    fake = f"curl() {{ printf '%s' {shlex.quote(host_network)}; }}"
    assert (
        subprocess.run(
            ["sh", "-c", f'{fake}\n{lookup}\necho "[$cip]"'], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        == "[]"
    )


def test_the_site_cache_host_reads_what_its_cache_holds_and_the_room_beside_it(tmp_path):
    # Only the host that runs the site cache reads it; the others' snapshot has no such section.
    assert not any(call.startswith("read_site_cache") for call in host_command.steps(PATHS))
    storage = tmp_path / "docker-registry"
    (storage / "docker").mkdir(parents=True)
    (storage / "docker" / "blob").write_bytes(b"x" * 300_000)
    line = step(dataclasses.replace(PATHS, site_cache_storage=str(storage)), "read_site_cache")
    ran = subprocess.run(["sh", "-c", f"d={tmp_path}\n{line}"], capture_output=True, text=True, check=True)
    snap = parse_snapshot(output(site_cache=ran.stdout.split("\n", 2)[2].splitlines()))
    assert snap.site_cache_used_kib is not None and snap.site_cache_used_kib >= 290
    assert snap.free_kib["site_cache"] > 0 and snap.free_path["site_cache"] == str(storage)
    assert snap.site_cache_shares_docker  # $d, Docker's, is on the same filesystem here
    # A cache not set up yet: nothing held, its room measured at the nearest directory there is.
    gone_paths = dataclasses.replace(PATHS, site_cache_storage=str(tmp_path / "no" / "x"))
    gone = subprocess.run(
        ["sh", "-c", f"d=/\n{step(gone_paths, 'read_site_cache')}"], capture_output=True, text=True, check=True
    ).stdout
    snap = parse_snapshot(output(site_cache=gone.split("\n", 2)[2].splitlines()))
    assert snap.site_cache_used_kib == 0 and snap.free_path["site_cache"] == str(tmp_path)
    assert parse_snapshot(healthy()).site_cache_used_kib is None
