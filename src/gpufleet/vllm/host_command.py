"""The host snapshot's one command (gpufleet.vllm.facts runs it and parses its output): what it reads on a host
(Paths) and the shell that reads it.

A no-op re-converge should cost little more than connecting (bench/deploy_bench.py measures it), so instead of one
command per fact the deploy reads the host once: OS, GPUs (the exact nvidia-smi queries of gpufleet.facts.nvidia)
and their health (gpufleet.facts.gpu_health), free disk, Docker's daemon.json, package states, checksums of the
files the deploy writes, the repos' keys as they serve them now (only where a keyring is missing, or with
refresh_keys), the ledgers (gpufleet.hoststate.reader, as the rollout reads them), local images, the model
directory, unit states, the unit file vllm_service names (its first line tells gpufleet's units from others), what
really runs (systemd's view of the unit, the spec hash and digest its file pins, the running container's label and
image) and a readiness probe. Sections are separated by marker lines (gpufleet.hoststate.sections).

Its cost is paid on every host at every converge, and the hosts' CPU is what a fleet converge waits for: so it
starts few programs. Docker's images and containers come from the Engine API through the one curl that reads
everything else over HTTP (the docker CLI costs more CPU than the rest of the snapshot but nvidia-smi), small
pipelines are one program each, and nvidia-smi runs twice (the GPU and health queries), not three times, while the
driver's version file (driver_lines) names the driver its GPU query reports.

The command is read-only: nothing on the host changes (preflight relies on that). Every program in it that can
hang on a broken host (nvidia-smi on a wedged driver, systemctl waiting on its daemon, df on a dead mount) runs
under `timeout`, and each of curl's requests (docker's API, the repos, the server) has its own --max-time, so one
bad host gives one preflight line instead of holding up the fleet.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
import urllib.parse
from dataclasses import dataclass

from gpufleet.facts.gpu_health import kernel_shell, query_shell
from gpufleet.facts.nvidia import QUERY_GPUS, QUERY_VERSION
from gpufleet.hoststate import reader
from gpufleet.hoststate.sections import MARK, end, marker, print_file
from gpufleet.names import LOOPBACK, container_label_key, url_host
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm.weights import MARKER
from gpufleet.wire.metrics import CACHE_CONFIG

DAEMON_JSON = "/etc/docker/daemon.json"
# Where dockerd listens unless daemon.json's "hosts" says otherwise (the docker CLI, without DOCKER_HOST, uses it too).
DOCKER_SOCKET = "/var/run/docker.sock"
# The sections of the Engine API's answers (the docker CLI's, on a host without curl, are "images" and "running").
DOCKER_IMAGES, DOCKER_CONTAINERS = "docker_images", "docker_containers"
# The section of `nvidia-smi --version` when read from Paths.nvidia_version_file instead of nvidia-smi.
DRIVER_FILE = "driver_file"
GPU_HEALTH, KERNEL_LOG = "gpu_health", "kernel_log"
# Seconds any one program in the snapshot may take (nvidia-smi starts slowly on drivers without persistence mode;
# a healthy host answers everything in well under a second). `timeout` exits 124 when it cut the program off, and
# 128+9 when the program ignored SIGTERM and had to be killed (-k): both mean "did not answer in time".
COMMAND_TIMEOUT_S = 20
TIMED_OUT = (124, 137)
# What the snapshot asks systemd of docker.service and of the service's unit (one `systemctl show` for both).
SYSTEMD_PROPERTIES = ("Id", "LoadState", "ActiveState", "SubState", "UnitFileState", "FragmentPath",
                      "NeedDaemonReload", "NRestarts")
PACKAGES = ("docker.io", "containerd", "docker-ce", "docker-ce-cli", "containerd.io", "nvidia-container-toolkit",
            "curl", "ca-certificates")


@dataclass(frozen=True)
class Paths:
    """What the snapshot reads on a host. dirs and files: exactly what the operations manage
    (gpufleet.vllm.operations.managed_paths), so no write is ever decided without its current state."""

    service: str
    models_dir: str  # where free space for models is measured
    model_dir: str  # the served model's directory (listed for completeness)
    dirs: tuple[str, ...]  # dirs whose owner/mode the deploy manages
    files: tuple[str, ...]  # files whose sha256 the deploy compares
    ledger_path: str
    env_file: str
    port: int
    nvidia_key_url: str
    docker_repo_url: str | None  # docker-ce only: its key lives at <url>/<os id>/gpg
    # Where each repo's key is installed: a key is fetched only when its file is missing or refresh_keys is set,
    # so a no-op converge sends no request off the host (the keys rotate once in years).
    nvidia_keyring: str
    docker_keyring: str
    # `nvidia-smi --version` as last read live (gpufleet.vllm.operations.nvidia writes it): printed instead of running
    # it again while it names the driver the GPU query reports. None: always ask nvidia-smi.
    nvidia_version_file: str | None = None
    refresh_keys: bool = False  # gpufleet_refresh_keys: fetch both keys even where installed (a rotated key)
    address: str = LOOPBACK  # where the host reaches the port (ServeSpec.reach_address)
    site_cache_storage: str | None = None  # the site cache's storage, on the host that runs it: its size and room
    group_head: tuple[str, int] | None = None  # a group's rank: its head's address and master port, probed


def snapshot_command(paths: Paths) -> str:
    q = shlex.quote
    timed_out = "|".join(map(str, TIMED_OUT))

    def nvidia(name: str, query: str, answered: str = "") -> str:
        # rc and stderr are kept: a broken driver must surface as a message, not as "no GPUs".
        # After a timeout the driver is wedged: skip the other queries (each would wait as long again).
        # answered: shell run when the query exited 0, its output in $g.
        return (f"{marker(name)}; if [ $nv = 1 ]; then g=$($t {query} 2>&1); r=$?; "
                f"printf '%s\\n@@rc %s\\n' \"$g\" \"$r\"; case $r in {timed_out}) nv=0;; 0) {answered};; esac; fi")

    port = int(paths.port)  # an int, never text, in the curl URLs below
    address = url_host(str(ipaddress.ip_address(paths.address)))  # an IP address (settings refuse anything else)
    dirs = " ".join(q(d) for d in paths.dirs)
    files = " ".join(q(f) for f in paths.files)
    model_dir = q(paths.model_dir)
    unit = q(unit_name(paths.service))
    label = container_label_key(paths.service)
    # docker ps's Image is the reference the container was started from while that still names the container's
    # image (always, for the digest references gpufleet's units run), else the image ID: either way it differs
    # from the unit's pin exactly when the container runs something else. The Engine API's "Image" is the same.
    container_format = f'Container={{{{.Label "{label}"}}}}|{{{{.Image}}}}'
    labelled = urllib.parse.quote(json.dumps({"label": [label]}, separators=(",", ":")), safe="")

    def next_mark(name: str) -> str:  # curl -w: after a transfer, the marker of the section that follows
        return q(f"\\n{MARK}{name}\\n")

    # Docker's Engine API on its socket, in the one curl below: the listings `docker images` and `docker ps` make
    # (unversioned paths: every engine serves them), at a fraction of the CLI's CPU. -f: an error answer is no
    # listing; a daemon that is down or hangs gives an empty section, as the CLI's empty output did. --noproxy: a
    # proxy set in root's environment must not take a request meant for the socket. The label's key travels in
    # the marker: process() needs it to read the containers' label values.
    docker_api = f"-fs --max-time {COMMAND_TIMEOUT_S} --noproxy '*' --unix-socket {DOCKER_SOCKET} http://localhost"
    docker_gets = (f"{docker_api}/images/json -w {next_mark(DOCKER_CONTAINERS + ' ' + label)} "
                   f"--next {docker_api}{q('/containers/json?filters=' + labelled)} -w {next_mark('health')} ")

    # The repo keys come first, each only when its keyring is missing or refresh_keys asks: an installed key
    # stands (it rotates once in years), so a no-op converge sends nothing off the host and does not depend on
    # the key servers. The decision uses shell builtins only (`[ -f ]`, `set --`): curl's argument list is built
    # back to front, so each key request's -w names the section that follows it ($n), and the marker of the
    # section curl's first answer belongs to is printed before curl starts.
    def key_get(name: str, keyring: str, url: str, prepare: str = "") -> str:
        get = f"{prepare}set -- -fsSL --max-time 15 {url} -w \"\\n{MARK}$n\\n\" --next \"$@\"; n={name}"
        return f"{{ {get}; }}; " if paths.refresh_keys else f"[ -f {q(keyring)} ] || {{ {get}; }}; "

    keys = f"n={DOCKER_IMAGES}; set --; "
    if paths.docker_repo_url:  # docker-ce: its key lives at <url>/<os id>/gpg
        keys += key_get("docker_key", paths.docker_keyring, f"{q(paths.docker_repo_url)}/\"$ID\"/gpg",
                        prepare="ID=; . /etc/os-release; ")
    keys += key_get("nvidia_key", paths.nvidia_keyring, q(paths.nvidia_key_url))
    keys += f"[ $n = nvidia_key ] || printf '\\n{MARK}%s\\n' \"$n\"; "

    # The docker CLI is the fallback for a host without curl (the deploy installs curl): the same listings.
    no_curl = "! command -v curl >/dev/null && command -v docker >/dev/null &&"
    lines = [
        "export LC_ALL=C",
        # A newline, for cutting systemctl's output with the shell's own ${...%%...} (printf is a builtin).
        "nl=$(printf '\\n.'); nl=${nl%.}",
        # -k: a program that ignores SIGTERM (nvidia-smi stuck in the kernel) is killed 2 s later.
        f"t='timeout -k 2 {COMMAND_TIMEOUT_S}'; command -v timeout >/dev/null 2>&1 || t=",
        "nv=0; command -v nvidia-smi >/dev/null 2>&1 && nv=1",
        f"{marker('os')}; {print_file(q('/etc/os-release'))}",
        f"{marker('arch')}; dpkg --print-architecture 2>/dev/null || uname -m",
        f"{marker('nvidia_smi')}; echo $nv",
        # The GPU query's output is kept ($g) for its first row's driver_version (the 7th field: GPU_FIELDS).
        "gd=; " + nvidia("gpus", QUERY_GPUS, answered="gd=${g%%\"$nl\"*}; gd=${gd#*, *, *, *, *, *, }; gd=${gd%%,*}; "
                          "case $gd in ''|*[!0-9.]*) gd=;; esac"),
        *driver_lines(paths.nvidia_version_file, nvidia("driver", QUERY_VERSION)),
        # GPU health, where the GPU query listed GPUs ($gd).
        f"{marker(GPU_HEALTH)}; if [ $nv = 1 ] && [ -n \"$gd\" ]; then {query_shell()}; case $r in {timed_out}) nv=0;; "
        "esac; fi",
        f"{marker(KERNEL_LOG)}; [ $nv = 1 ] && [ -n \"$gd\" ] && {{ {kernel_shell()}; }}",
        f"{marker('daemon_json')}; dr=; {print_file(q(DAEMON_JSON), 'case $l in *data-root*) dr=1;; esac; ')}",
        # Docker keeps images under data-root; read it without needing a JSON parser or a running daemon (sed only
        # when a line names it: most files do not).
        "root=; [ -n \"$dr\" ] && "
        f"root=$(sed -n 's/.*\"data-root\"[[:space:]]*:[[:space:]]*\"\\([^\"]*\\)\".*/\\1/p' {q(DAEMON_JSON)} 2>/dev/null)",
        # df of the nearest existing ancestor of each place (one df for both).
        f"d=${{root:-/var/lib/docker}}; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; m={q(paths.models_dir)}; "
        "while [ ! -e \"$m\" ]; do m=$(dirname \"$m\"); done",
        # df hangs on a dead network mount. Its 4th column is the free KiB (the shell's read splits the rows).
        f"{marker('free')}; $t df -Pk \"$d\" \"$m\" | {{ read -r _; read -r _ _ _ a _; read -r _ _ _ b _; "
        "echo \"docker $d $a\"; echo \"models $m $b\"; }",
        *([] if paths.site_cache_storage is None else [site_cache_lines(paths.site_cache_storage)]),
        *([] if paths.group_head is None else [group_probe_lines(*paths.group_head)]),
        f"{marker('packages')}; dpkg-query -W -f='${{Package}} ${{db:Status-Abbrev}} ${{Version}}\\n' "
        f"{' '.join(PACKAGES)} 2>/dev/null",
        f"{marker('files')}; sha256sum {files} 2>/dev/null",  # a missing file is simply not listed
        # The service's ledger and the state dir's others, as the rollout reads them too.
        *reader.read_lines(paths.ledger_path),
        f"{marker('images')}; {no_curl} $t docker images --digests --no-trunc "
        "--format '{{.Repository}}|{{.Tag}}|{{.Digest}}' 2>/dev/null",
        # One find for the top-level files and hf's partial downloads (any depth), one awk for the shards the index
        # names (process() sorts them and keeps the first partial downloads).
        f"{marker('model')}; if [ -d {model_dir} ]; then cd {model_dir} && "
        "find . \\( -path '*huggingface/download*' -name '*.incomplete' -printf 'incomplete %p\\n' \\) -o "
        "\\( -path './*' ! -path './*/*' -type f -printf '%f %s\\n' \\) 2>/dev/null; "
        "[ -f model.safetensors.index.json ] && awk '{ while (match($0, /\"[^\"]*\\.safetensors\"/)) { "
        "s[substr($0, RSTART + 1, RLENGTH - 2)] = 1; $0 = substr($0, RSTART + RLENGTH) } } "
        "END { for (n in s) print \"shard \" n }' model.safetensors.index.json; "
        f"[ -f {MARKER} ] && sed -n '1s/^/checked /p' {MARKER}; cd /; fi",
        f"{marker('dirs')}; stat -c '%U %G %a %n' {dirs} 2>/dev/null",
        # systemd's view of docker.service and the service's unit, in one call (one block each, in this order: the
        # parser takes the second for the service); then, with shell builtins only, the first line of the unit
        # file systemd loaded (our header, or not) and the pins in the header of the file gpufleet writes.
        f"{marker('units')}; sd=$($t systemctl show -p {' -p '.join(SYSTEMD_PROPERTIES)} docker.service {unit} "
        "2>/dev/null); printf '%s\\n' \"$sd\"",
        f"{marker('service_unit')}; f=${{sd##*FragmentPath=}}; f=${{f%%\"$nl\"*}}; l=; "
        "if [ -n \"$f\" ]; then { IFS= read -r l < \"$f\"; } 2>/dev/null; printf 'FirstLine=%s\\n' \"$l\"; fi",
        # What really runs: the labelled containers (docker's API below), each with its label and its image.
        f"{marker('running')}; h=; {{ read -r h; IFS= read -r h; }} < {q(unit_path(paths.service))} 2>/dev/null; "
        "printf 'Header=%s\\n' \"$h\"; "
        f"{no_curl} $t docker ps --no-trunc --filter label={q(label)} --format {q(container_format)} 2>/dev/null",
        # One curl for every HTTP read (each --next is its own request with its own options; -w prints the next
        # section's marker after each): the repo keys that are needed (above), docker's listings, then readiness,
        # the served models and the cache config labels (vLLM's /metrics needs no key). The API key never reaches
        # a command line: printf is a builtin, curl reads the header from stdin, and sends it to /v1/models only.
        # awk keeps only the cache config lines of /metrics.
        # The server is read at the labelled container's own address (docker's API names it; sed keeps an IPv4
        # one), inside its network namespace: a local user's listener that bound the published port first never
        # gets the key, nor a say in the answers. The key goes only to a running labelled container; with host
        # networking (no address of its own) to the published port, as before.
        "cj=; cip=; if command -v curl >/dev/null; then "
        f"cj=$(curl -fs --max-time {COMMAND_TIMEOUT_S} --noproxy '*' --unix-socket {DOCKER_SOCKET} "
        f"{q('http://localhost/containers/json?filters=' + labelled)} 2>/dev/null); "
        "cip=$(printf '%s' \"$cj\" | sed -n 's/.*\"IPAddress\":\"\\([0-9][0-9.]*[0-9]\\)\".*/\\1/p' | head -n 1); fi",
        f"{marker('nvidia_key')}; if command -v curl >/dev/null; then svc=${{cip:-{address}}}; "
        f"(VLLM_API_KEY=; [ -f {q(paths.env_file)} ] && . {q(paths.env_file)}; "
        "case \"$cj\" in *'\"Id\"'*) ;; *) VLLM_API_KEY= ;; esac; "
        "if [ -n \"$VLLM_API_KEY\" ]; then printf 'Authorization: Bearer %s\\n' \"$VLLM_API_KEY\"; fi) | "
        f"({keys}curl \"$@\" {docker_gets}"
        f"--next -s --max-time 3 -o /dev/null -w '%{{http_code}}\\n' \"http://$svc:{port}/health\" "
        f"--next -s --max-time 3 -H @- \"http://$svc:{port}/v1/models\" -w {next_mark('cache_config')} "
        f"--next -s --max-time 3 \"http://$svc:{port}/metrics\") 2>/dev/null | "
        f"awk '$0 == \"{MARK}cache_config\" {{ c = 1; print; next }} !c || index($0, \"{CACHE_CONFIG}{{\") == 1'; fi",
        end(),
    ]
    return "\n".join(lines)


def site_cache_lines(storage: str) -> str:
    """The site cache's storage: the KiB it holds (du), the KiB free on its filesystem, and whether that is Docker's
    ($d, measured just before)."""
    c = shlex.quote(storage)
    return (f"{marker('site_cache')}; u=$($t du -sk {c} 2>/dev/null | cut -f1); echo \"used ${{u:-0}}\"; c={c}; "
            "while [ ! -e \"$c\" ]; do c=$(dirname \"$c\"); done; $t df -Pk \"$d\" \"$c\" | { read -r _; "
            "read -r fd _ _ _ _; read -r fc _ _ a _; echo \"free $a $c\"; [ \"$fd\" != \"$fc\" ] || echo shares_docker; }")


# Seconds a rank's probe of its head's master port may take: a filtered port answers nothing, ever.
GROUP_PROBE_TIMEOUT_S = 5


def group_probe_lines(address: str, port: int) -> str:
    """A rank reaching its head's master port: one connect through bash's /dev/tcp, nothing sent. Connected or
    refused means the head's host answered; a timeout or no route means the ranks cannot meet."""
    connect = f"exec 3<>/dev/tcp/{ipaddress.ip_address(address)}/{int(port)}"
    return (f"{marker('group_probe')}; timeout -k 1 {GROUP_PROBE_TIMEOUT_S} bash -c {shlex.quote(connect)} 2>&1; "
            'echo "rc $?"')


def driver_lines(version_file: str | None, live: str) -> list[str]:
    """The snapshot's driver section: `live` (nvidia-smi --version), or the version file's lines when it names the
    driver the GPU query just reported ($gd) with a CUDA version. The CUDA version nvidia-smi reports comes with
    the driver (its libcuda), so it changes only with the driver; one nvidia-smi call less per converge, each
    costing the host more CPU than most of the snapshot. Shell builtins only: no program runs for a file hit.
    A file that names another driver, lacks a line or is missing means asking nvidia-smi, as without the file.
    """
    if version_file is None:
        return [live]
    # vk collects "d" for the matching DRIVER line and "c" for a numeric CUDA line: "dc", in nvidia-smi's order.
    return [
        f"vf=; vk=; if [ -n \"$gd\" ]; then while IFS= read -r l || [ -n \"$l\" ]; do vf=$vf$l$nl; case $l in "
        "'DRIVER version'*:*) [ \"${l##* }\" = \"$gd\" ] && vk=${vk}d;; "
        "'CUDA Version'*:*) case ${l##* } in ''|*[!0-9.]*) ;; *) vk=${vk}c;; esac;; esac; "
        f"done 2>/dev/null < {shlex.quote(version_file)}; fi",
        # The live branch first: a line is timed under its first marker's section (bench/noop_breakdown.py).
        f"if [ \"$vk\" != dc ]; then {live}; else printf '\\n{MARK}{DRIVER_FILE}\\n%s' \"$vf\"; fi",
    ]
