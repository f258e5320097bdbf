"""Bad input, class by class: each case gets exactly one line naming host, setting and fix, before anything
touches a host; values that are allowed however hostile they look render safely (split back by the tests' systemd
word splitter, parsed into the same directives, and accepted by `systemd-analyze verify`). docs/hardening.md lists
the classes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpufleet.errors import SettingErrors
from gpufleet.vllm.flags import known_flags
from gpufleet.vllm.serve_args import NOT_SECRET_FLAGS
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.unit import DOCKER, render_unit, stop_timeouts
from gpufleet.vllm.value_rules import says_secret
from tests.unit.systemd_words import split_exec, unit_directives

CONTROL_CHARACTERS = [
    (
        {"vllm_args": {"served-model-name": "m\nExecStartPre=/bin/sh -c id"}},
        "box7: vllm_args['served-model-name']: holds a control character (U+000A), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"served-model-name": "m\rExecStartPre=/bin/id"}},
        "box7: vllm_args['served-model-name']: holds a control character (U+000D), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"served-model-name": "m\x00x"}},
        "box7: vllm_args['served-model-name']: holds a control character (U+0000), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\tb"}},
        "box7: vllm_args['chat-template']: holds a control character (U+0009), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\u2028b"}},
        "box7: vllm_args['chat-template']: holds a control character (U+2028), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\u2029b"}},
        "box7: vllm_args['chat-template']: holds a control character (U+2029), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\x85b"}},
        "box7: vllm_args['chat-template']: holds a control character (U+0085), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\x1bb"}},
        "box7: vllm_args['chat-template']: holds a control character (U+001B), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"chat-template": "a\x7fb"}},
        "box7: vllm_args['chat-template']: holds a control character (U+007F), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_args": {"override-generation-config": {"stop": ["\n"]}}},
        "box7: vllm_args['override-generation-config']['stop'][0]: holds a control character (U+000A), which would end a line "
        "of the systemd unit (fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_env": {"OMP_NUM_THREADS": "8\n"}},
        "box7: vllm_env['OMP_NUM_THREADS']: holds a control character (U+000A), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_env": {"A\nB": "1"}},
        "box7: vllm_env['A\\nB']: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"vllm_docker_options": {"shm-size": "16g\nExecStartPre=/bin/id"}},
        "box7: vllm_docker_options['shm-size']: holds a control character (U+000A), which would end a line of the systemd unit "
        "(fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_docker_options": {"ulimit": ["nofile=1024", "core=0\n"]}},
        "box7: vllm_docker_options['ulimit'][1]: holds a control character (U+000A), which would end a line of the systemd "
        "unit (fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_docker_options": {"shm\n-size": "16g"}},
        "box7: vllm_docker_options['shm\\n-size']: holds a control character (U+000A), which would end a line of the systemd "
        "unit (fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_model": "qwen\n"},
        "box7: vllm_model: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_models_dir": "/srv/models\n"},
        "box7: vllm_models_dir: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"vllm_cache_dir": "/srv/cache\r"},
        "box7: vllm_cache_dir: holds a control character (U+000D), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_service": "vllm\n"},
        "box7: vllm_service: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_image": "vllm/vllm-openai:nightly\n"},
        "box7: vllm_image: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_api_key": "sk-abc\n"},
        "box7: vllm_api_key: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_hf_token": "hf_abc\x00"},
        "box7: vllm_hf_token: holds a control character (U+0000), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
    (
        {"vllm_secret_env": {"WANDB_API_KEY": "abc\n"}},
        "box7: vllm_secret_env['WANDB_API_KEY']: holds a control character (U+000A), which would end a line of the systemd "
        "unit (fix: remove it: only printable characters are allowed)",
    ),
    (
        {"vllm_model_repo": "Qwen/Qwen3.5\n"},
        "box7: vllm_model_repo: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"vllm_model_revision": "main\n"},
        "box7: vllm_model_revision: holds a control character (U+000A), which would end a line of the systemd unit (fix: "
        "remove it: only printable characters are allowed)",
    ),
    (
        {"gpufleet_min_cuda": "13.0\n"},
        "box7: gpufleet_min_cuda: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/linux\n"},
        "box7: docker_repo_url: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"nvidia_repo_url": "https://nvidia.github.io/x\r\n"},
        "box7: nvidia_repo_url: holds a control character (U+000D), which would end a line of the systemd unit (fix: remove "
        "it: only printable characters are allowed)",
    ),
    (
        {"docker_install": "distro\n"},
        "box7: docker_install: holds a control character (U+000A), which would end a line of the systemd unit (fix: remove it: "
        "only printable characters are allowed)",
    ),
]

SECRETS = [
    (
        {"vllm_args": {"hf-token": "hf_abc"}},
        "box7: vllm_args['hf-token']: --hf-token carries a secret, which would show in the unit, `ps` and `gpufleet render` "
        "(fix: set vllm_hf_token instead)",
    ),
    (
        {"vllm_args": {"hf_token": None}},
        "box7: vllm_args['hf_token']: --hf-token carries a secret, which would show in the unit, `ps` and `gpufleet render` "
        "(fix: set vllm_hf_token instead)",
    ),
    (
        {"vllm_args": {"api-key": "sk-x"}},
        "box7: vllm_args['api-key']: --api-key carries a secret, which would show in the unit, `ps` and `gpufleet render` "
        "(fix: set vllm_api_key instead)",
    ),
    (
        {"vllm_args": {"--api-key": "sk-x"}},
        "box7: vllm_args['--api-key']: --api-key carries a secret, which would show in the unit, `ps` and `gpufleet render` "
        "(fix: set vllm_api_key instead)",
    ),
    (
        {"vllm_env": {"WANDB_API_KEY": "abc"}},
        "box7: vllm_env['WANDB_API_KEY']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['WANDB_API_KEY'] instead)",
    ),
    (
        {"vllm_env": {"OPENAI_API_KEY": "abc"}},
        "box7: vllm_env['OPENAI_API_KEY']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['OPENAI_API_KEY'] instead)",
    ),
    (
        {"vllm_env": {"GITHUB_TOKEN": "abc"}},
        "box7: vllm_env['GITHUB_TOKEN']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['GITHUB_TOKEN'] instead)",
    ),
    (
        {"vllm_env": {"AWS_SECRET_ACCESS_KEY": "abc"}},
        "box7: vllm_env['AWS_SECRET_ACCESS_KEY']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['AWS_SECRET_ACCESS_KEY'] instead)",
    ),
    (
        {"vllm_env": {"PGPASSWORD": "abc"}},
        "box7: vllm_env['PGPASSWORD']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['PGPASSWORD'] instead)",
    ),
    (
        {"vllm_env": {"DB_PASSWD": "abc"}},
        "box7: vllm_env['DB_PASSWD']: names a secret, which would land in the unit and `ps` (fix: set "
        "vllm_secret_env['DB_PASSWD'] instead)",
    ),
    (
        {"vllm_env": {"HF_TOKEN": "abc"}},
        "box7: vllm_env['HF_TOKEN']: is a secret and would land in the unit and `ps` (fix: set vllm_hf_token instead)",
    ),
    (
        {"vllm_env": {"HUGGING_FACE_HUB_TOKEN": "abc"}},
        "box7: vllm_env['HUGGING_FACE_HUB_TOKEN']: is a secret and would land in the unit and `ps` (fix: set vllm_hf_token "
        "instead)",
    ),
    (
        {"vllm_env": {"VLLM_API_KEY": "abc"}},
        "box7: vllm_env['VLLM_API_KEY']: is a secret and would land in the unit and `ps` (fix: set vllm_api_key instead)",
    ),
    (
        {"vllm_docker_options": {"env": "HF_TOKEN=abc"}},
        "box7: vllm_docker_options['env']: is managed by gpufleet (fix: use vllm_env (secrets: vllm_secret_env))",
    ),
    (
        {"vllm_docker_options": {"env=HF_TOKEN=abc": True}},
        "box7: vllm_docker_options['env=HF_TOKEN=abc']: is managed by gpufleet (fix: use vllm_env (secrets: vllm_secret_env))",
    ),
    (
        {"vllm_docker_options": {"--env=HF_TOKEN=abc": True}},
        "box7: vllm_docker_options['--env=HF_TOKEN=abc']: is managed by gpufleet (fix: use vllm_env (secrets: "
        "vllm_secret_env))",
    ),
    (
        {"vllm_docker_options": {"e": "HF_TOKEN=abc"}},
        "box7: vllm_docker_options['e']: is managed by gpufleet (fix: use vllm_env (secrets: vllm_secret_env))",
    ),
    (
        {"vllm_docker_options": {"-e HF_TOKEN=abc": True}},
        "box7: vllm_docker_options['-e HF_TOKEN=abc']: is managed by gpufleet (fix: use vllm_env (secrets: vllm_secret_env))",
    ),
    (
        {"vllm_docker_options": {"env-file": "/root/.secrets"}},
        "box7: vllm_docker_options['env-file']: is managed by gpufleet (fix: use vllm_secret_env (the unit's root-only env "
        "file))",
    ),
    (
        {"vllm_api_key": "sk abc"},
        "box7: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_api_key": "sk-$HOME"},
        "box7: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_api_key": 'sk-"quoted"'},
        "box7: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_api_key": "sk-back\\slash"},
        "box7: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_api_key": "sk-'single'"},
        "box7: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_api_key": ""},
        "box7: vllm_api_key: must be a non-empty string or None (value not shown) (fix: set the secret as a string)",
    ),
    (
        {"vllm_hf_token": "hf abc"},
        "box7: vllm_hf_token: holds characters an env file cannot carry unquoted (value not shown) (fix: use a value of "
        "letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_hf_token": 12345},
        "box7: vllm_hf_token: must be a non-empty string or None (value not shown) (fix: set the secret as a string)",
    ),
    (
        {"vllm_secret_env": {"WANDB_API_KEY": "a b"}},
        "box7: vllm_secret_env['WANDB_API_KEY']: holds characters an env file cannot carry unquoted (value not shown) (fix: "
        "use a value of letters, digits and ._+/=:@- only)",
    ),
    (
        {"vllm_secret_env": {"WANDB_API_KEY": 5}},
        "box7: vllm_secret_env['WANDB_API_KEY']: must be a non-empty string (value not shown) (fix: set the secret as a "
        "string)",
    ),
    (
        {"vllm_secret_env": {"VLLM_API_KEY": "abc"}},
        "box7: vllm_secret_env['VLLM_API_KEY']: is set by vllm_api_key (fix: set vllm_api_key instead)",
    ),
    (
        {"vllm_secret_env": {"HF_TOKEN": "abc"}},
        "box7: vllm_secret_env['HF_TOKEN']: is set by vllm_hf_token (fix: set vllm_hf_token instead)",
    ),
    (
        {"vllm_secret_env": {"bad-name": "abc"}},
        "box7: vllm_secret_env['bad-name']: is not an environment variable name (fix: use letters, digits and '_')",
    ),
    (
        {"vllm_secret_env": {"OMP_NUM_THREADS": "abc"}},
        "box7: vllm_secret_env['OMP_NUM_THREADS']: is also a plain env var (vllm_env or the profile), which would show its "
        "value (fix: remove it there: vllm_env {'OMP_NUM_THREADS': None})",
    ),
    (
        {"vllm_secret_env": {"LD_PRELOAD": "/tmp/x.so"}},
        "box7: vllm_secret_env['LD_PRELOAD']: would also be the environment of the docker CLI and shells the unit runs as root "
        "(fix: use a name of the container's own, e.g. WANDB_API_KEY)",
    ),
    (
        {"vllm_secret_env": {"PATH": "/tmp"}},
        "box7: vllm_secret_env['PATH']: would also be the environment of the docker CLI and shells the unit runs as root (fix: "
        "use a name of the container's own, e.g. WANDB_API_KEY)",
    ),
    (
        {"vllm_secret_env": {"DOCKER_HOST": "tcp://evil:2375"}},
        "box7: vllm_secret_env['DOCKER_HOST']: would also be the environment of the docker CLI and shells the unit runs as "
        "root (fix: use a name of the container's own, e.g. WANDB_API_KEY)",
    ),
    (
        {"vllm_secret_env": ["WANDB_API_KEY=abc"]},
        'box7: vllm_secret_env: is not a mapping (value not shown) (fix: use e.g. {"WANDB_API_KEY": "..."})',
    ),
]

DOCKER_OPTIONS = [
    (
        {"vllm_docker_options": {"volume": "/:/host"}},
        "box7: vllm_docker_options['volume']: is managed by gpufleet (fix: use vllm_models_dir / vllm_cache_dir)",
    ),
    (
        {"vllm_docker_options": {"volume=/:/host": True}},
        "box7: vllm_docker_options['volume=/:/host']: is managed by gpufleet (fix: use vllm_models_dir / vllm_cache_dir)",
    ),
    (
        {"vllm_docker_options": {"v": "/:/host"}},
        "box7: vllm_docker_options['v']: is managed by gpufleet (fix: use vllm_models_dir / vllm_cache_dir)",
    ),
    (
        {"vllm_docker_options": {"mount": "type=bind,src=/,dst=/host"}},
        "box7: vllm_docker_options['mount']: is managed by gpufleet (fix: use vllm_models_dir / vllm_cache_dir)",
    ),
    (
        {"vllm_docker_options": {"volumes-from": "other"}},
        "box7: vllm_docker_options['volumes-from']: is managed by gpufleet (fix: use vllm_models_dir / vllm_cache_dir)",
    ),
    (
        {"vllm_docker_options": {"rm": True}},
        "box7: vllm_docker_options['rm']: is managed by gpufleet (fix: remove it: --rm is always set)",
    ),
    (
        {"vllm_docker_options": {"restart": "always"}},
        "box7: vllm_docker_options['restart']: is managed by gpufleet (fix: remove it: systemd restarts the service "
        "(Restart=on-failure))",
    ),
    (
        {"vllm_docker_options": {"detach": True}},
        "box7: vllm_docker_options['detach']: is managed by gpufleet (fix: remove it: systemd supervises the container in the "
        "foreground)",
    ),
    (
        {"vllm_docker_options": {"d": True}},
        "box7: vllm_docker_options['d']: is managed by gpufleet (fix: remove it: systemd supervises the container in the "
        "foreground)",
    ),
    (
        {"vllm_docker_options": {"name": "vllm"}},
        "box7: vllm_docker_options['name']: is managed by gpufleet (fix: use vllm_service)",
    ),
    (
        {"vllm_docker_options": {"label": "x=y"}},
        "box7: vllm_docker_options['label']: is managed by gpufleet (fix: use vllm_service)",
    ),
    (
        {"vllm_docker_options": {"label-file": "/etc/labels"}},
        "box7: vllm_docker_options['label-file']: is managed by gpufleet (fix: use vllm_service)",
    ),
    (
        {"vllm_docker_options": {"publish": "80:80"}},
        "box7: vllm_docker_options['publish']: is managed by gpufleet (fix: use vllm_port)",
    ),
    (
        {"vllm_docker_options": {"p": "80:80"}},
        "box7: vllm_docker_options['p']: is managed by gpufleet (fix: use vllm_port)",
    ),
    (
        {"vllm_docker_options": {"publish-all": True}},
        "box7: vllm_docker_options['publish-all']: is managed by gpufleet (fix: use vllm_port)",
    ),
    (
        {"vllm_docker_options": {"gpus": "all"}},
        "box7: vllm_docker_options['gpus']: is managed by gpufleet (fix: use vllm_gpus)",
    ),
    (
        {"vllm_docker_options": {"cidfile": "/tmp/cid"}},
        "box7: vllm_docker_options['cidfile']: is managed by gpufleet (fix: remove it: the container is found by its label)",
    ),
    (
        {"vllm_docker_options": {"tty": True}},
        "box7: vllm_docker_options['tty']: is managed by gpufleet (fix: remove it: systemd runs the container without a "
        "terminal)",
    ),
    (
        {"vllm_docker_options": {"interactive": True}},
        "box7: vllm_docker_options['interactive']: is managed by gpufleet (fix: remove it: systemd runs the container without "
        "a terminal)",
    ),
    (
        {"vllm_docker_options": {"m": "16g"}},
        "box7: vllm_docker_options['m']: is a one-letter option, which would render as --m= (fix: use its long name, "
        '"memory")',
    ),
    (
        {"vllm_docker_options": {"u": "1000"}},
        "box7: vllm_docker_options['u']: is a one-letter option, which would render as --u= (fix: use its long name, \"user\")",
    ),
    (
        {"vllm_docker_options": {"x": "1"}},
        "box7: vllm_docker_options['x']: is a one-letter option, which would render as --x= (fix: use its long name (see "
        "`docker run --help`))",
    ),
    (
        {"vllm_docker_options": {"Shm-Size": "16g"}},
        "box7: vllm_docker_options['Shm-Size']: is not a docker run option name (fix: use its long name without dashes, e.g. "
        '"shm-size")',
    ),
    (
        {"vllm_docker_options": {"shm_size": "16g"}},
        "box7: vllm_docker_options['shm_size']: is not a docker run option name (fix: use its long name without dashes, e.g. "
        '"shm-size")',
    ),
    (
        {"vllm_docker_options": {"shm-size=16g": True}},
        "box7: vllm_docker_options['shm-size=16g']: puts a value in the option's name (fix: write {\"shm-size\": <value>})",
    ),
    (
        {"vllm_docker_options": {"1ulimit": "x"}},
        "box7: vllm_docker_options['1ulimit']: is not a docker run option name (fix: use its long name without dashes, e.g. "
        '"shm-size")',
    ),
    (
        {"vllm_docker_options": {"shm-size": 16}},
        "box7: vllm_docker_options['shm-size']: 16 is not True, a string or a list of strings (fix: e.g. {\"shm-size\": "
        '"16g"})',
    ),
    (
        {"vllm_docker_options": {"ulimit": []}},
        'box7: vllm_docker_options[\'ulimit\']: [] is not True, a string or a list of strings (fix: e.g. {"shm-size": "16g"})',
    ),
]

DANGEROUS_VALUES = [
    (
        {"vllm_publish_address": "localhost"},
        "box7: vllm_publish_address: 'localhost' is not an IP address of the host (fix: use None (every interface) or an "
        'address such as "127.0.0.1")',
    ),
    (
        {"vllm_publish_address": "127.0.0.1:5000"},
        "box7: vllm_publish_address: '127.0.0.1:5000' is not an IP address of the host (fix: use None (every interface) or "
        'an address such as "127.0.0.1")',
    ),
    (
        {"vllm_publish_address": 2130706433},
        "box7: vllm_publish_address: 2130706433 is not an IP address of the host (fix: use None (every interface) or an "
        'address such as "127.0.0.1")',
    ),
    (
        {"vllm_service": "ssh"},
        "box7: vllm_service: 'ssh' names a system unit, which the deploy would replace and restart (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "sshd"},
        "box7: vllm_service: 'sshd' names a system unit, which the deploy would replace and restart (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "docker"},
        "box7: vllm_service: 'docker' names a system unit, which the deploy would replace and restart (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "containerd"},
        "box7: vllm_service: 'containerd' names a system unit, which the deploy would replace and restart (fix: use a name of "
        'its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "systemd-journald"},
        "box7: vllm_service: 'systemd-journald' names a system unit, which the deploy would replace and restart (fix: use a "
        'name of its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "dbus"},
        "box7: vllm_service: 'dbus' names a system unit, which the deploy would replace and restart (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "cron"},
        "box7: vllm_service: 'cron' names a system unit, which the deploy would replace and restart (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "networking"},
        "box7: vllm_service: 'networking' names a system unit, which the deploy would replace and restart (fix: use a name of "
        'its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "getty-static"},
        "box7: vllm_service: 'getty-static' names a system unit, which the deploy would replace and restart (fix: use a name "
        'of its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "NetworkManager"},
        "box7: vllm_service: 'NetworkManager' names a system unit, which the deploy would replace and restart (fix: use a name "
        'of its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "nvidia-persistenced"},
        "box7: vllm_service: 'nvidia-persistenced' names a system unit, which the deploy would replace and restart (fix: use a "
        'name of its own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "vllm.service"},
        "box7: vllm_service: 'vllm.service' carries a unit suffix; gpufleet adds .service itself (fix: set \"vllm\")",
    ),
    (
        {"vllm_service": "sshd.service"},
        "box7: vllm_service: 'sshd.service' carries a unit suffix; gpufleet adds .service itself (fix: use a name of its own, "
        'e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "multi-user.target"},
        "box7: vllm_service: 'multi-user.target' carries a unit suffix; gpufleet adds .service itself (fix: use a name of its "
        'own, e.g. "vllm-qwen35")',
    ),
    (
        {"vllm_service": "vllm@1"},
        "box7: vllm_service: 'vllm@1' is not a valid unit/label name (fix: use letters, digits, '-', '_' and '.')",
    ),
    (
        {"vllm_service": "-vllm"},
        "box7: vllm_service: '-vllm' is not a valid unit/label name (fix: use letters, digits, '-', '_' and '.')",
    ),
    (
        {"vllm_models_dir": "/"},
        "box7: vllm_models_dir: '/' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/tmp"},
        "box7: vllm_models_dir: '/tmp' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/var/tmp/"},
        "box7: vllm_models_dir: '/var/tmp/' is a system directory, which the deploy would chown to root and chmod 755 (fix: "
        "use a directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/etc"},
        "box7: vllm_models_dir: '/etc' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/usr/local"},
        "box7: vllm_models_dir: '/usr/local' is a system directory, which the deploy would chown to root and chmod 755 (fix: "
        "use a directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/srv/../etc"},
        "box7: vllm_models_dir: '/srv/../etc' is a system directory, which the deploy would chown to root and chmod 755 (fix: "
        "use a directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "//etc"},
        "box7: vllm_models_dir: '//etc' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/etc/ssh"},
        "box7: vllm_models_dir: '/etc/ssh' is a system directory, which the deploy would chown to root and chmod 755 (fix: use "
        "a directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_models_dir": "/proc/self"},
        "box7: vllm_models_dir: '/proc/self' is a system directory, which the deploy would chown to root and chmod 755 (fix: "
        "use a directory of its own, e.g. /srv/vllm/models)",
    ),
    (
        {"vllm_cache_dir": "/var/lib"},
        "box7: vllm_cache_dir: '/var/lib' is a system directory, which the deploy would chown to root and chmod 755 (fix: use "
        "a directory of its own, e.g. /var/cache/vllm/qwen35)",
    ),
    (
        {"vllm_cache_dir": "/var/lib/docker/volumes"},
        "box7: vllm_cache_dir: '/var/lib/docker/volumes' is a system directory, which the deploy would chown to root and chmod "
        "755 (fix: use a directory of its own, e.g. /var/cache/vllm/qwen35)",
    ),
    (
        {"vllm_cache_dir": "/home"},
        "box7: vllm_cache_dir: '/home' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /var/cache/vllm/qwen35)",
    ),
    (
        {"vllm_cache_dir": "/root"},
        "box7: vllm_cache_dir: '/root' is a system directory, which the deploy would chown to root and chmod 755 (fix: use a "
        "directory of its own, e.g. /var/cache/vllm/qwen35)",
    ),
    (
        {"vllm_cache_dir": "/boot/efi"},
        "box7: vllm_cache_dir: '/boot/efi' is a system directory, which the deploy would chown to root and chmod 755 (fix: use "
        "a directory of its own, e.g. /var/cache/vllm/qwen35)",
    ),
    (
        {"vllm_models_dir": "/srv/a:b"},
        "box7: vllm_models_dir: '/srv/a:b' holds ':' or ',', which docker's -v and --mount split on (fix: use a path without "
        "':' or ',')",
    ),
    (
        {"vllm_cache_dir": "/srv/a,b"},
        "box7: vllm_cache_dir: '/srv/a,b' holds ':' or ',', which docker's -v and --mount split on (fix: use a path without "
        "':' or ',')",
    ),
    (
        {"vllm_cache_dir": "cache"},
        "box7: vllm_cache_dir: 'cache' is not an absolute path (fix: use an absolute path (systemd does not expand ~))",
    ),
    (
        {"vllm_model_repo": "--local-dir=/etc"},
        "box7: vllm_model_repo: '--local-dir=/etc' is not a Hugging Face repo id (fix: use \"namespace/name\", e.g. "
        '"Qwen/Qwen3.5-27B-FP8", or None)',
    ),
    (
        {"vllm_model_repo": "org/repo; rm -rf /"},
        "box7: vllm_model_repo: 'org/repo; rm -rf /' is not a Hugging Face repo id (fix: use \"namespace/name\", e.g. "
        '"Qwen/Qwen3.5-27B-FP8", or None)',
    ),
    (
        {"vllm_model_revision": "-x"},
        "box7: vllm_model_revision: '-x' is not a branch, tag or commit (fix: e.g. \"main\" or a commit hash, or None)",
    ),
    (
        {"vllm_model": "../escape"},
        "box7: vllm_model: '../escape' is not a directory name under vllm_models_dir (fix: set e.g. \"qwen3.5-awq\")",
    ),
]

PARALLEL_SIZES = [
    (
        {"vllm_args": {"data-parallel-size": 2}},
        "box7: vllm_gpus: 3 GPU(s) listed but data-parallel-size 2 x tensor-parallel-size 1 x pipeline-parallel-size 3 = 6 "
        "(fix: list 6 GPUs)",
    ),
    (
        {"vllm_args": {"tensor-parallel-size": 3, "pipeline-parallel-size": 1, "data-parallel-size": 2}},
        "box7: vllm_gpus: 3 GPU(s) listed but data-parallel-size 2 x tensor-parallel-size 3 x pipeline-parallel-size 1 = 6 "
        "(fix: list 6 GPUs)",
    ),
    (
        {"vllm_gpus": [0, 1, 2, 3], "vllm_args": {"pipeline-parallel-size": 2, "tensor-parallel-size": 3}},
        "box7: vllm_gpus: 4 GPU(s) listed but tensor-parallel-size 3 x pipeline-parallel-size 2 = 6 (fix: list 6 GPUs)",
    ),
    (
        {"vllm_gpus": [0, 1, 2, 3], "vllm_args": {"data-parallel-size": 2, "pipeline-parallel-size": 1}},
        "box7: vllm_gpus: 4 GPU(s) listed but data-parallel-size 2 x tensor-parallel-size 1 x pipeline-parallel-size 1 = 2 "
        "(fix: list 2 GPUs or set vllm_args pipeline-parallel-size to 2)",
    ),
    (
        {"vllm_args": {"pipeline-parallel-size": 0}},
        "box7: vllm_args['pipeline-parallel-size']: --pipeline-parallel-size must be an integer >= 1, not '0' (fix: give a "
        "whole number)",
    ),
    (
        {"vllm_args": {"data-parallel-size": "two"}},
        "box7: vllm_args['data-parallel-size']: --data-parallel-size must be an integer >= 1, not 'two' (fix: give a whole "
        "number)",
    ),
]

ARGUMENT_SIZE = [
    (
        {"vllm_args": {"chat-template": "x" * 131073}},
        "box7: vllm_args['chat-template']: makes a 131073-byte command-line argument, over Linux's 131072-byte limit (execve "
        "fails) (fix: shorten it, or put it in a file under vllm_models_dir and pass the path)",
    ),
    (
        {"vllm_args": {"override-generation-config": {"stop": "x" * 131073}}},
        "box7: vllm_args['override-generation-config']: makes a 131085-byte command-line argument, over Linux's 131072-byte "
        "limit (execve fails) (fix: shorten it, or put it in a file under vllm_models_dir and pass the path)",
    ),
    (
        {"vllm_env": {"BIG": "x" * 131073}},
        "box7: vllm_env['BIG']: makes a 131077-byte command-line argument, over Linux's 131072-byte limit (execve fails) (fix: "
        "shorten it, or put it in a file under vllm_models_dir and pass the path)",
    ),
    (
        {"vllm_docker_options": {"add-host": "x" * 131073}},
        "box7: vllm_docker_options['add-host']: makes a 131084-byte command-line argument, over Linux's 131072-byte limit "
        "(execve fails) (fix: shorten it, or put it in a file under vllm_models_dir and pass the path)",
    ),
    (
        {"vllm_docker_options": {"ulimit": ["nofile=1", "x" * 131073]}},
        "box7: vllm_docker_options['ulimit']: makes a 131073-byte command-line argument, over Linux's 131072-byte limit "
        "(execve fails) (fix: shorten it, or put it in a file under vllm_models_dir and pass the path)",
    ),
    (
        {"vllm_env": {f"V{i}": "x" * 130000 for i in range(9)}},
        "box7: vllm_args / vllm_env / vllm_docker_options: the docker run line is 1171467 bytes, over the 1044480 bytes a "
        "systemd unit line can hold (fix: shorten the longest values)",
    ),
]

JSON = [
    (
        {"vllm_args": {"override-generation-config": {"stop": {1, 2}}}},
        "box7: vllm_args['override-generation-config']: is not JSON-serialisable (TypeError: Object of type set is not JSON "
        'serializable) (fix: give a JSON object, e.g. {"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"override-generation-config": {"temperature": float("nan")}}},
        "box7: vllm_args['override-generation-config']: is not JSON-serialisable (ValueError: Out of range float values are "
        'not JSON compliant) (fix: give a JSON object, e.g. {"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"override-generation-config": {"x": object}}},
        "box7: vllm_args['override-generation-config']: is not JSON-serialisable (TypeError: Object of type type is not JSON "
        'serializable) (fix: give a JSON object, e.g. {"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"override-generation-config": '{"temperature": NaN}'}},
        "box7: vllm_args['override-generation-config']: is not valid JSON (NaN is not JSON) (fix: give a JSON object, e.g. "
        '{"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"override-generation-config": "{temperature: 1}"}},
        "box7: vllm_args['override-generation-config']: is not valid JSON (Expecting property name enclosed in double quotes "
        'at char 1) (fix: give a JSON object, e.g. {"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"override-generation-config": "[1, 2]"}},
        "box7: vllm_args['override-generation-config']: must be a JSON object (fix: give a JSON object, e.g. {\"temperature\": "
        "0.6})",
    ),
    (
        {"vllm_args": {"compilation-config": {"level": float("inf")}}},
        "box7: vllm_args['compilation-config']: is not JSON-serialisable (ValueError: Out of range float values are not JSON "
        'compliant) (fix: give a JSON object, e.g. {"temperature": 0.6})',
    ),
    (
        {"vllm_args": {"max-model-len": {"a": 1}}},
        "box7: vllm_args['max-model-len']: --max-model-len does not take a mapping (fix: give a string or number)",
    ),
    (
        {"vllm_args": {"model": None}},
        "box7: vllm_args['model']: cannot be removed: the service serves vllm_model through --model (fix: set vllm_model to "
        "change the model)",
    ),
    (
        {"vllm_args": {"model": "/models/other"}},
        "box7: vllm_args['model']: is managed by a setting (fix: set vllm_model (the directory under vllm_models_dir) instead)",
    ),
]

IMAGE_REFERENCES = [
    (
        {"vllm_image": "Vllm/Vllm-openai:nightly"},
        "box7: vllm_image: 'Vllm/Vllm-openai:nightly' is not an image reference (fix: use \"repo:tag\" or "
        '"repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": "vllm/vllm-openai:nightly; rm -rf /"},
        "box7: vllm_image: 'vllm/vllm-openai:nightly; rm -rf /' is not an image reference (fix: use \"repo:tag\" or "
        '"repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": "vllm/vllm-openai::nightly"},
        "box7: vllm_image: 'vllm/vllm-openai::nightly' is not an image reference (fix: use \"repo:tag\" or "
        '"repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": "vllm/vllm-openai@sha256:abc"},
        "box7: vllm_image: 'vllm/vllm-openai@sha256:abc' is not an image reference (fix: use \"repo:tag\" or "
        '"repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": "-vllm/vllm-openai"},
        'box7: vllm_image: \'-vllm/vllm-openai\' is not an image reference (fix: use "repo:tag" or "repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": "vllm/vllm-openai:" + "t" * 129},
        "box7: vllm_image: 'vllm/vllm-openai:ttttttttttttttttttttttttttttttttttttttttttttttttttttttttttt... is not an image "
        'reference (fix: use "repo:tag" or "repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": ""},
        'box7: vllm_image: \'\' is not an image reference (fix: use "repo:tag" or "repo@sha256:<digest>")',
    ),
    (
        {"vllm_image": None},
        'box7: vllm_image: None is not an image reference (fix: use "repo:tag" or "repo@sha256:<digest>")',
    ),
]

URLS = [
    (
        {"docker_repo_url": "https://download.docker.com/linux;id"},
        "box7: docker_repo_url: 'https://download.docker.com/linux;id' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/linux&id"},
        "box7: docker_repo_url: 'https://download.docker.com/linux&id' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/$(id)"},
        "box7: docker_repo_url: 'https://download.docker.com/$(id)' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/`id`"},
        "box7: docker_repo_url: 'https://download.docker.com/`id`' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/linux|sh"},
        "box7: docker_repo_url: 'https://download.docker.com/linux|sh' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/a b"},
        "box7: docker_repo_url: 'https://download.docker.com/a b' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/'x'"},
        "box7: docker_repo_url: \"https://download.docker.com/'x'\" is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": 'https://download.docker.com/"x"'},
        "box7: docker_repo_url: 'https://download.docker.com/\"x\"' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://download.docker.com/linux?x=1"},
        "box7: docker_repo_url: 'https://download.docker.com/linux?x=1' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"docker_repo_url": "https://user:pw@download.docker.com/linux"},
        "box7: docker_repo_url: 'https://user:pw@download.docker.com/linux' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://download.docker.com/linux)",
    ),
    (
        {"nvidia_repo_url": "ftp://nvidia.github.io/x"},
        "box7: nvidia_repo_url: 'ftp://nvidia.github.io/x' is not a plain http(s) URL (fix: use http(s)://host[:port]/path of "
        "letters, digits and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
    (
        {"nvidia_repo_url": "file:///etc/passwd"},
        "box7: nvidia_repo_url: 'file:///etc/passwd' is not a plain http(s) URL (fix: use http(s)://host[:port]/path of "
        "letters, digits and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
    (
        {"nvidia_repo_url": "https://"},
        "box7: nvidia_repo_url: 'https://' is not a plain http(s) URL (fix: use http(s)://host[:port]/path of letters, digits "
        "and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
    (
        {"nvidia_repo_url": "https://-bad.example/x"},
        "box7: nvidia_repo_url: 'https://-bad.example/x' is not a plain http(s) URL (fix: use http(s)://host[:port]/path of "
        "letters, digits and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
    (
        {"nvidia_repo_url": "https://nvidia.github.io:99999999/x"},
        "box7: nvidia_repo_url: 'https://nvidia.github.io:99999999/x' is not a plain http(s) URL (fix: use "
        "http(s)://host[:port]/path of letters, digits and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
    (
        {"nvidia_repo_url": "https://nvidia.github.io/x>y"},
        "box7: nvidia_repo_url: 'https://nvidia.github.io/x>y' is not a plain http(s) URL (fix: use http(s)://host[:port]/path "
        "of letters, digits and ._~+-, e.g. https://nvidia.github.io/libnvidia-container)",
    ),
]

NUMBERS = [
    (
        {"vllm_ready_timeout": float("nan")},
        "box7: vllm_ready_timeout: nan is not a finite non-negative number (fix: e.g. 1800)",
    ),
    (
        {"vllm_ready_timeout": float("inf")},
        "box7: vllm_ready_timeout: inf is not a finite non-negative number (fix: e.g. 1800)",
    ),
    (
        {"vllm_ready_soak_s": float("-inf")},
        "box7: vllm_ready_soak_s: -inf is not a finite non-negative number (fix: e.g. 20)",
    ),
    (
        {"gpufleet_min_free_gb_docker": float("nan")},
        "box7: gpufleet_min_free_gb_docker: nan is not a finite non-negative number (fix: e.g. 60)",
    ),
    (
        {"gpufleet_min_free_gb_models": 10**400},
        "box7: gpufleet_min_free_gb_models: 10000000000000000000000000000000000000000000000000000000000000000000000000000... "
        "is not a finite non-negative number (fix: e.g. 40)",
    ),
    (
        {"vllm_ready_timeout": True},
        "box7: vllm_ready_timeout: True is not a finite non-negative number (fix: e.g. 1800)",
    ),
    (
        {"vllm_ready_timeout": "1800"},
        "box7: vllm_ready_timeout: '1800' is not a finite non-negative number (fix: e.g. 1800)",
    ),
    (
        {"vllm_args": {"gpu-memory-utilization": float("nan")}},
        "box7: vllm_args['gpu-memory-utilization']: --gpu-memory-utilization nan is not a finite number (fix: give a finite "
        "number)",
    ),
    (
        {"vllm_args": {"gpu-memory-utilization": "nan"}},
        "box7: vllm_args['gpu-memory-utilization']: --gpu-memory-utilization nan is not a finite number (fix: give a finite "
        "number)",
    ),
    (
        {"vllm_args": {"gpu-memory-utilization": "inf"}},
        "box7: vllm_args['gpu-memory-utilization']: --gpu-memory-utilization inf is not a finite number (fix: give a finite "
        "number)",
    ),
    (
        {"vllm_args": {"shutdown-timeout": "Infinity"}},
        "box7: vllm_args['shutdown-timeout']: --shutdown-timeout Infinity is not a finite number (fix: give a finite number)",
    ),
    (
        {"vllm_args": {"shutdown-timeout": -1}},
        "box7: vllm_args['shutdown-timeout']: --shutdown-timeout must be an integer >= 0, not '-1' (fix: give a whole number)",
    ),
    (
        {"vllm_env": {"RATIO": float("inf")}},
        "box7: vllm_env['RATIO']: inf is not a finite number (fix: give a finite number or a string, e.g. \"0.5\")",
    ),
]

GROUPS = {
    "control_characters": CONTROL_CHARACTERS,
    "secrets": SECRETS,
    "docker_options": DOCKER_OPTIONS,
    "dangerous_values": DANGEROUS_VALUES,
    "parallel_sizes": PARALLEL_SIZES,
    "argument_size": ARGUMENT_SIZE,
    "json": JSON,
    "image_references": IMAGE_REFERENCES,
    "urls": URLS,
    "numbers": NUMBERS,
}
ALL = [(group, data, line) for group, cases in GROUPS.items() for data, line in cases]


def test_there_are_at_least_a_hundred_cases_in_every_class():
    assert len(ALL) >= 100 and all(GROUPS.values())


@pytest.mark.parametrize(
    ("group", "data", "line"), ALL, ids=[f"{g}-{i}" for g, cases in GROUPS.items() for i in range(len(cases))]
)
def test_bad_input_gets_exactly_one_line(group, data, line):
    with pytest.raises(SettingErrors) as raised:
        build_spec("box7", data)
    assert str(raised.value) == line


SECRET_CASES = [
    (data, value)
    for data, _ in SECRETS + CONTROL_CHARACTERS
    for key, value in data.items()
    if key in ("vllm_api_key", "vllm_hf_token") and value
]
SECRET_CASES += [
    (data, value)
    for data, _ in SECRETS + CONTROL_CHARACTERS
    if isinstance(data.get("vllm_secret_env"), dict)
    for value in data["vllm_secret_env"].values()
]


@pytest.mark.parametrize(("data", "secret"), SECRET_CASES)
def test_secret_values_are_never_echoed(data, secret):
    with pytest.raises(SettingErrors) as raised:
        build_spec("box7", data)
    assert str(secret) not in str(raised.value)


def test_a_host_name_with_a_control_character_is_one_escaped_line():
    with pytest.raises(SettingErrors) as raised:
        build_spec("box\nExecStartPre=/bin/id", {})
    assert str(raised.value) == (
        "box\\nExecStartPre=/bin/id: inventory host name: holds a control character (U+000A), which would break the "
        "unit's header and every log line (fix: rename the host in the inventory)"
    )


def test_secret_words_refuse_only_flags_that_carry_secrets():
    """The one tested list: every vLLM value flag whose name says token/key/secret/password is refused, except the
    token-count thresholds (integers, not secrets); switches carry no value."""
    flags = known_flags()
    secret_named = {name for name, info in flags.items() if info.takes_value and says_secret(name)}
    assert secret_named - NOT_SECRET_FLAGS == {"api-key", "hf-token"}
    assert all(flags[name].value_type == "int" for name in NOT_SECRET_FLAGS)
    spec = build_spec(
        "box",
        {
            "vllm_args": dict.fromkeys(NOT_SECRET_FLAGS, 256) | {"return-tokens-as-token-ids": True},
            "vllm_env": {"TOKENIZERS_PARALLELISM": "false", "VLLM_KEEP_ALIVE": "1"},
        },
    )
    assert spec.arg("long-prefill-token-threshold") == "256"
    assert not says_secret("ssl-keyfile") and says_secret("WANDB_API_KEY") and says_secret("PGPASSWORD")


# --- allowed, however hostile: rendered safely -----------------------------------------------------------------
HOSTILE = [
    "x ExecStart=/nonexistent/injected",
    "[Service] ExecStartPre=/nonexistent/injected",
    "%n %z %% %",
    "$HOME ${PATH} $$",
    "double \"quotes\" and single 'quotes'",
    "back\\slash and trailing \\",
    "semi;colon # hash",
    "Qwën 模型 \u200b",
]


def hostile_spec(value: str):
    return build_spec(
        f"box {value}",
        {
            "vllm_args": {"served-model-name": value, "chat-template": value},
            "vllm_env": {"HOSTILE": value},
            "vllm_docker_options": {"security-opt": value, "add-host": [value, value]},
        },
    )


def exec_start(unit: str) -> list[str]:
    return split_exec(next(v for s, k, v in unit_directives(unit) if k == "ExecStart"))


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_render_as_the_same_directives_and_the_exact_argv(value):
    spec = hostile_spec(value)
    unit = render_unit(spec)
    plain = render_unit(build_spec("box", {}))
    assert [(s, k) for s, k, _ in unit_directives(unit)] == [(s, k) for s, k, _ in unit_directives(plain)]
    assert exec_start(unit) == spec.docker_run_argv(docker=DOCKER)
    description = next(v for s, k, v in unit_directives(unit) if k == "Description")
    assert description.replace("%%", "%").startswith(f"vLLM server vllm-qwen35 ({value} on GPUs")
    assert unit.splitlines()[0].startswith("# Managed by gpufleet (box ")


def analyze(tmp_path: Path, unit: str) -> list[str]:
    path = tmp_path / "vllm-qwen35.service"
    path.write_text(unit)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )
    # systemd < 254 does not know the backoff keys (the unit says so); without docker installed, ExecStart's binary
    # is missing: neither is about what the values did to the unit.
    noise = (
        "Unknown key 'RestartSteps'",
        "Unknown key 'RestartMaxDelaySec'",
        f"Command {DOCKER} is not executable",
        "docker.service",
    )
    return [line for line in (result.stdout + result.stderr).splitlines() if line and not any(n in line for n in noise)]


needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")


@needs_systemd_analyze
@pytest.mark.parametrize("value", HOSTILE)
def test_systemd_accepts_hostile_values_without_a_word_of_complaint(tmp_path, value):
    assert analyze(tmp_path, render_unit(hostile_spec(value))) == []


@needs_systemd_analyze
def test_systemd_analyze_does_catch_what_escaping_prevents(tmp_path):
    """The check above can fail: an unescaped specifier or a smuggled line is reported."""
    unit = render_unit(build_spec("box", {}))
    specifier = unit.replace("Description=vLLM server", "Description=%z vLLM server")
    assert any("Failed to resolve unit specifiers" in line for line in analyze(tmp_path, specifier))
    injected = unit.replace(
        "Description=vLLM server", "Description=x\n[Service]\nExecStart=/nonexistent/injected\n[Unit]\n#"
    )
    assert any("more than one ExecStart" in line for line in analyze(tmp_path, injected))


# --- secrets: extra env vars, by name only ---------------------------------------------------------------------
def test_secret_env_reaches_the_container_by_name_only():
    from gpufleet.quoting import shell_line
    from gpufleet.vllm.operations.service import env_content, secret_values
    from gpufleet.vllm.settings import resolve_host

    data = {"vllm_secret_env": {"WANDB_API_KEY": "wandb-s3cr3t-value"}, "vllm_api_key": "sk-apikey-value"}
    spec, settings = resolve_host("box", data)
    argv = spec.docker_run_argv()
    assert argv[argv.index("WANDB_API_KEY") - 1] == "-e" and argv[argv.index("VLLM_API_KEY") - 1] == "-e"
    rendered = shell_line(argv) + render_unit(spec) + repr(spec)
    assert "s3cr3t" not in rendered and "apikey-value" not in rendered
    content = env_content(secret_values(settings))
    assert content.splitlines()[1:] == ["VLLM_API_KEY=sk-apikey-value", "WANDB_API_KEY=wandb-s3cr3t-value"]


# --- stop timeouts above vLLM's own graceful shutdown -----------------------------------------------------------
@pytest.mark.parametrize(
    ("shutdown", "docker_stop", "timeout_stop"),
    [(None, 60, 90), (0, 60, 90), (20, 60, 90), (45, 75, 105), (600, 630, 660)],
)
def test_stop_timeouts_sit_above_vllm_shutdown_timeout(shutdown, docker_stop, timeout_stop):
    spec = build_spec("box", {"vllm_args": {"shutdown-timeout": shutdown}})
    assert stop_timeouts(spec) == (docker_stop, timeout_stop)
    unit = render_unit(spec)
    assert f"xargs -r docker stop --time {docker_stop}'" in unit and f"\nTimeoutStopSec={timeout_stop}\n" in unit


# --- the deploy path: the same lines, before any fact is read ---------------------------------------------------
def test_the_deploy_preflight_turns_setting_errors_into_lines_without_reading_the_host():
    from pyinfra.api import Config, Inventory, State

    from gpufleet.harness.preflight import Reading, read_host
    from gpufleet.vllm.deploy import check_host, plan_for
    from gpufleet.vllm.host_read import HOST_READ

    inventory = Inventory(([("box7", {"vllm_service": "sshd"}), ("box8", {"vllm_api_key": "sk-$HOME"})], {}))
    state = State(inventory, Config())
    # No connector is ever used: a host read would fail here, and would show as a "could not read" line.
    assert [read_host(state, host, plan_for, check_host, HOST_READ) for host in inventory] == [
        Reading(
            None,
            None,
            [
                "box7: vllm_service: 'sshd' names a system unit, which the deploy would replace and restart "
                '(fix: use a name of its own, e.g. "vllm-qwen35")'
            ],
        ),
        Reading(
            None,
            None,
            [
                "box8: vllm_api_key: holds characters an env file cannot carry unquoted (value not shown) "
                "(fix: use a value of letters, digits and ._+/=:@- only)"
            ],
        ),
    ]
