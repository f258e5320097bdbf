"""The serve spec reproduces the write-up's invocation, and every rendering runs exactly its argv."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from gpufleet.quoting import shell_line, systemd_exec
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import render_unit
from tests.unit.systemd_words import split_exec

SEED_HOST_PATHS = {  # the write-up's host paths -> ours (host paths are settings, everything else is the profile)
    "/home/daniel/vllm/models": "/srv/vllm/models",
    "~/.cache/qwen35/vllm": "/var/cache/vllm/qwen35/vllm",
    "~/.cache/qwen35/torch": "/var/cache/vllm/qwen35/torch",
    "~/.nv/qwen35/ComputeCache": "/var/cache/vllm/qwen35/ComputeCache",
}


def sh_argv(command_line: str) -> list[str]:
    """Let a real POSIX shell parse the line (continuations, quoting), with `docker` printing its argv."""
    script = 'docker() { printf "%s\\0" docker "$@"; }\n' + command_line
    out = subprocess.run(["sh", "-c", script], capture_output=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    return out.decode().split("\0")[:-1]


@pytest.fixture
def seed_tokens(fixtures_dir) -> list[str]:
    text = (fixtures_dir / "seed" / "docker-run.sh").read_text()
    # Keep the write-up's unexpanded label variable and ~ paths visible as tokens: quote them for the shell.
    text = text.replace('"$CONTAINER_LABEL"', "'$CONTAINER_LABEL'").replace(" ~/", " '~'/")
    return sh_argv(text)


def normalise(tokens: list[str]) -> list[str]:
    out = []
    for token in tokens:
        if token == "$CONTAINER_LABEL" or token.startswith("gpufleet.vllm-qwen35="):
            token = "<label>"
        for seed_path, ours in SEED_HOST_PATHS.items():
            if token.startswith(seed_path + ":"):
                token = ours + token[len(seed_path) :]
        out.append(token)
    return out


def test_render_equals_published_invocation_token_for_token(seed_tokens):
    spec = build_spec("write-up-box", {"vllm_gpus": [0, 1, 2], "vllm_port": 5000})
    assert normalise(spec.docker_run_argv()) == normalise(seed_tokens)


def test_shell_line_parses_back_to_the_argv():
    spec = build_spec("box", {})
    assert sh_argv(shell_line(spec.docker_run_argv())) == spec.docker_run_argv()


def test_unit_exec_start_runs_exactly_the_spec_argv():
    spec = build_spec("box", {"vllm_image": "registry.local:5000/vllm/vllm-openai@sha256:" + "a" * 64})
    unit = render_unit(spec)
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert split_exec(exec_start.removeprefix("ExecStart=")) == spec.docker_run_argv(docker="/usr/bin/docker")


def test_unit_runs_the_pinned_image_not_the_tag():
    spec = build_spec("box", {})
    image_ref = "vllm/vllm-openai@sha256:" + "b" * 64
    argv = split_exec(
        next(line for line in render_unit(spec, image_ref).splitlines() if line.startswith("ExecStart="))[10:]
    )
    assert image_ref in argv and spec.image not in argv


@pytest.mark.parametrize(
    "value",
    [
        "a value with spaces",
        'double "quotes"',
        "single 'quotes'",
        "dollar $HOME and ${X}",
        "percent %h %%",
        "back\\slash",
        "mix: \"$A\" '%b' \\ end",
    ],
)
def test_quoting_survives_shell_and_systemd(value):
    spec = build_spec("box", {"vllm_env": {"ODD_VALUE": value}, "vllm_args": {"chat-template": value}})
    argv = spec.docker_run_argv()
    assert f"ODD_VALUE={value}" in argv and value in argv
    assert sh_argv(shell_line(argv)) == argv
    assert split_exec(systemd_exec(argv)) == argv


def test_systemd_escapes_specifiers_and_variables():
    assert systemd_exec(["echo", "%h", "$HOME"]) == "echo %%h $$HOME"


def test_spec_hash_is_stable_and_tracks_changes():
    a, b = build_spec("a", {}), build_spec("b", {})
    assert a.spec_hash == b.spec_hash  # the inventory name is not part of the service's identity
    assert build_spec("a", {"vllm_port": 5001}).spec_hash != a.spec_hash
    assert a.container_label == f"gpufleet.vllm-qwen35={a.spec_hash}"
    assert f"--label={a.container_label}" not in a.docker_run_argv() and a.container_label in a.docker_run_argv()


def test_identity_properties_for_health_checks():
    spec = build_spec("box", {"vllm_model": "tiny", "vllm_args": {"max_model_len": "32k"}})
    assert (spec.served_model_name, spec.model_path, spec.max_model_len) == ("tiny", "/models/tiny", 32000)
    assert spec.prefix_caching and spec.mamba_cache_mode == "align"
    off = build_spec("box", {"vllm_args": {"enable-prefix-caching": False, "mamba-cache-mode": None}})
    assert "--no-enable-prefix-caching" in off.vllm_argv()
    assert not off.prefix_caching and off.mamba_cache_mode == "none"


def test_overrides_keep_profile_order_and_append_new_flags():
    spec = build_spec("box", {"vllm_args": {"max-num-seqs": 4, "prefix-match-unit": 128, "mamba-block-size": None}})
    argv = spec.vllm_argv()
    assert argv[argv.index("--max-num-seqs") + 1] == "4"
    assert argv.index("--max-num-seqs") < argv.index("--enable-prefix-caching")
    assert argv[-2:] == ["--prefix-match-unit", "128"] and "--mamba-block-size" not in argv


def test_secrets_are_passed_by_name_only():
    spec = build_spec("box", {"vllm_api_key": "sk-very-secret", "vllm_hf_token": "hf_secret"})
    rendered = " ".join(spec.docker_run_argv()) + render_unit(spec)
    assert "sk-very-secret" not in rendered and "hf_secret" not in rendered
    argv = spec.docker_run_argv()
    assert argv[argv.index("VLLM_API_KEY") - 1] == "-e"


@pytest.mark.parametrize(
    ("address", "publish"),
    [
        (None, "5000:5000"),
        ("127.0.0.1", "127.0.0.1:5000:5000"),
        ("::1", "[::1]:5000:5000"),
        ("0:0:0:0:0:0:0:1", "[::1]:5000:5000"),
    ],
)
def test_publish_address_renders_dockers_p_value(address, publish):
    argv = build_spec("a", {"vllm_publish_address": address}).docker_run_argv()
    assert argv[argv.index("-p") + 1] == publish


@pytest.mark.parametrize(
    ("address", "reach"),
    [
        (None, "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("::", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("10.0.0.12", "10.0.0.12"),
        ("::1", "::1"),
    ],
)
def test_the_host_reaches_a_port_published_on_one_address_there(address, reach):
    # Published on one host address, nothing answers on the loopback: the checks must dial that address.
    assert build_spec("a", {"vllm_publish_address": address}).reach_address == reach


def test_publish_address_unset_keeps_the_hash_so_upgrading_restarts_nothing():
    unset = build_spec("a", {})
    assert build_spec("a", {"vllm_publish_address": None}).spec_hash == unset.spec_hash
    assert build_spec("a", {"vllm_publish_address": "127.0.0.1"}).spec_hash != unset.spec_hash


def test_hf_download_writes_where_the_service_reads_and_takes_the_token_only_through_the_env_file():
    spec = build_spec("gpu1", {"vllm_models_dir": "/srv/m", "vllm_model": "q"})
    image = "img@sha256:" + "1" * 64
    argv = spec.hf_download_argv(
        image,
        "org/repo",
        "abc123",
        "/c/hf",
        "/etc/gpufleet/s.env",
        env={"HF_HUB_DISABLE_XET": "1", "HF_ENDPOINT": "http://cache:5001"},
    )
    assert argv[:7] == ["docker", "run", "--rm", "--network", "host", "--entrypoint", "hf"]
    assert argv[argv.index("--env-file") + 1] == "/etc/gpufleet/s.env"
    assert argv[argv.index("--env-file") + 2 : argv.index(image)] == [
        "-e",
        "HF_ENDPOINT=http://cache:5001",
        "-e",
        "HF_HUB_DISABLE_XET=1",
    ]
    # The download's mount and --local-dir are the serving container's model mount and --model.
    assert spec.model_mount.volume_arg() in spec.docker_run_argv() and argv[8] == spec.model_mount.volume_arg()
    assert (
        argv[argv.index(image) + 1 :]
        == ["download", "org/repo", "--local-dir", spec.model_path, "--revision", "abc123"]
        and spec.model_path == "/models/q"
    )
    assert "--env-file" not in spec.hf_download_argv("i", "r", None, None, None)


def test_the_model_mount_is_found_by_the_model_path_not_by_position():
    spec = build_spec("gpu1", {"vllm_models_dir": "/srv/m"})
    reordered = dataclasses.replace(spec, mounts=spec.mounts[::-1])
    assert reordered.model_mount == spec.model_mount and spec.model_mount.host_path == "/srv/m"


def test_the_models_commit_is_a_label_of_the_container_and_status_reads_it():
    from gpufleet.cli.health_tables import model_cell
    from gpufleet.remote.transport import pick_container
    from gpufleet.vllm.unit import render_unit

    spec = build_spec("gpu1", {"vllm_models_dir": "/srv/m"})
    at = "org/repo@" + "c" * 40
    argv = spec.docker_run_argv(model=at)
    assert argv[argv.index(spec.container_label) + 1 :][:2] == ["--label", f"gpufleet.{spec.service}.model={at}"]
    label = argv.index(f"gpufleet.{spec.service}.model={at}")
    assert spec.docker_run_argv() == argv[: label - 1] + argv[label + 1 :]
    assert render_unit(spec, model=at) != render_unit(spec) and f"# Model {at}." in render_unit(spec, model=at)
    inspected = {
        "Id": "abc",
        "State": {"Status": "running"},
        "Config": {"Labels": {f"gpufleet.{spec.service}": spec.spec_hash, f"gpufleet.{spec.service}.model": at}},
    }
    found = pick_container([inspected], f"gpufleet.{spec.service}")
    assert found is not None and found.model == at
    assert model_cell("qwen", found.model) == "qwen @cccccccccccc" and model_cell("qwen", None) == "qwen"
