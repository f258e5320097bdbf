"""One fact, one SSH round trip: everything the deploy decides from.

A no-op re-converge should cost little more than connecting (bench/deploy_bench.py measures it), so instead of one
command per fact the deploy reads the host once: OS, GPUs (the exact nvidia-smi queries of gpufleet.facts.nvidia),
free disk, Docker's daemon.json, package states, checksums of the files the deploy writes, the repos' keys as they
serve them now (only where a keyring is missing, or with refresh_keys), the image state file, local images, the
model directory, unit states, the unit file vllm_service names (its first line tells gpufleet's units from others),
what really runs (systemd's view of the unit, the spec hash and digest its file pins, the running container's label
and image) and a readiness probe. Sections are separated by marker lines; process() only parses.

Its cost is paid on every host at every converge, and the hosts' CPU is what a fleet converge waits for: so it
starts few programs. Docker's images and containers come from the Engine API through the one curl that reads
everything else over HTTP (the docker CLI costs more CPU than the rest of the snapshot but nvidia-smi), small
pipelines are one program each, and nvidia-smi runs once, not twice, while the driver's version file (driver_lines)
names the driver its GPU query reports.

The command is read-only: nothing on the host changes (preflight relies on that). Every program in it that can
hang on a broken host (nvidia-smi on a wedged driver, systemctl waiting on its daemon, df on a dead mount) runs
under `timeout`, and each of curl's requests (docker's API, the repos, the server) has its own --max-time, so one
bad host gives one preflight line instead of holding up the fleet.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
import shlex
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError

from gpufleet.facts.nvidia import QUERY_GPUS, QUERY_VERSION, Gpu, NvidiaVersion, parse_gpus, parse_version
from gpufleet.units import unit_name, unit_path
from gpufleet.vllm.spec import LOOPBACK, container_label_key, url_host
from gpufleet.wire.evidence import excerpt
from gpufleet.wire.identity import served_models
from gpufleet.wire.metrics import CACHE_CONFIG, parse_metrics

MARK = "@@gpufleet:"
DAEMON_JSON = "/etc/docker/daemon.json"
# Where dockerd listens unless daemon.json's "hosts" says otherwise (the docker CLI, without DOCKER_HOST, uses it too).
DOCKER_SOCKET = "/var/run/docker.sock"
# How a snapshot that carried a forged section is refused (preflight names the port's listener in its fix).
SNAPSHOT_REFUSED = "host snapshot refused"
# The sections of the Engine API's answers (the docker CLI's, on a host without curl, are "images" and "running").
DOCKER_IMAGES, DOCKER_CONTAINERS = "docker_images", "docker_containers"
# The section of `nvidia-smi --version` when read from Paths.nvidia_version_file instead of nvidia-smi.
DRIVER_FILE = "driver_file"
# Seconds any one program in the snapshot may take (nvidia-smi starts slowly on drivers without persistence mode;
# a healthy host answers everything in well under a second). `timeout` exits 124 when it cut the program off, and
# 128+9 when the program ignored SIGTERM and had to be killed (-k): both mean "did not answer in time".
COMMAND_TIMEOUT_S = 20
TIMED_OUT = (124, 137)
# How many of hf's partial downloads the snapshot keeps: a few name the problem; a failed download may leave many.
MAX_INCOMPLETE = 3
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


@dataclass(frozen=True)
class ServiceUnit:
    """What systemd knows of the unit vllm_service names (it may exist before gpufleet ever ran)."""

    name: str  # systemd's Id: an alias resolves to the unit it points at
    load_state: str  # "not-found" when no such unit exists
    fragment_path: str  # the unit file systemd loaded ("" for none)
    first_line: str  # of that file: gpufleet's units start with its "# Managed by gpufleet" header

    @property
    def exists(self) -> bool:
        return self.load_state not in ("", "not-found")


# The unit header's second line (templates/vllm.service.j2): what the unit file on disk runs.
UNIT_PINS = re.compile(r"^# Spec (?P<spec>[0-9a-f]+); image pinned to (?P<image>\S+)\.$")


@dataclass(frozen=True)
class RunningService:
    """What really runs for the service, next to what its unit file says should: a unit written but never loaded
    (a run cut between the upload and daemon-reload), or a container started by hand or from an older unit,
    differs here while every file checksum matches."""

    active_state: str = ""  # systemd's ActiveState/SubState of the unit
    sub_state: str = ""
    need_daemon_reload: bool = False  # the file on disk is not what systemd loaded
    unit_spec_hash: str | None = None  # pinned in the unit file's header (None: no gpufleet unit on disk)
    unit_image: str | None = None
    containers: tuple[tuple[str, str], ...] = ()  # running containers with the service's label: (label, image)
    restarts: int = 0  # systemd's NRestarts: automatic restarts (Restart=on-failure) since the last start

    @property
    def running_image(self) -> str | None:
        """The one labelled container's image (None: none, or more than one)."""
        return self.containers[0][1] if len(self.containers) == 1 else None

    @property
    def running_spec_hash(self) -> str | None:
        return self.containers[0][0] if len(self.containers) == 1 else None

    def drift(self) -> list[str]:
        """How what runs differs from the unit on disk, one phrase each ([] = it runs what the unit says).
        Only a gpufleet unit that systemd runs is compared: a stopped service is started by the deploy anyway."""
        problems = []
        if self.need_daemon_reload:
            problems.append("systemd has not loaded the unit file on disk (NeedDaemonReload=yes)")
        if self.unit_spec_hash is None or self.active_state != "active":
            return problems
        for label, image in self.containers:
            if label != self.unit_spec_hash:
                problems.append(f"the container runs spec {label or 'unlabelled'}, the unit spec {self.unit_spec_hash}")
            if image != self.unit_image:
                problems.append(f"the container runs {image}, the unit pins {self.unit_image}")
        if len(self.containers) > 1:
            problems.append(f"{len(self.containers)} containers carry the service's label")
        return problems


@dataclass
class HostSnapshot:
    os: dict[str, str] = field(default_factory=dict)
    arch: str = ""
    nvidia_smi: bool = False  # nvidia-smi is on PATH
    gpus: list[Gpu] = field(default_factory=list)
    driver: NvidiaVersion | None = None
    # `nvidia-smi --version` as it answered now; None when not asked (the version file named the same driver) or
    # when its answer was unusable. What the version file must hold.
    driver_output: str | None = None
    driver_from_file: bool = False  # driver came from Paths.nvidia_version_file, not from nvidia-smi
    nvidia_error: str | None = None  # nvidia-smi present but its output unusable
    daemon_json: dict[str, Any] | None = None  # None: no file
    daemon_json_error: str | None = None
    free_kib: dict[str, int] = field(default_factory=dict)  # "docker"/"models" -> KiB free
    free_path: dict[str, str] = field(default_factory=dict)  # the directory actually measured
    packages: dict[str, str] = field(default_factory=dict)  # installed package -> version
    file_sha256: dict[str, str | None] = field(default_factory=dict)
    # Armored keys as the repos serve them now; fetched only for a missing keyring or with refresh_keys, so None
    # also means "not asked" (an installed keyring then stands) or "the key server did not answer".
    nvidia_key: str | None = None
    docker_key: str | None = None
    ledger_text: str | None = None  # the service's ledger file (gpufleet.hoststate.ledger parses it); None: no file
    other_ledgers: dict[str, str] = field(default_factory=dict)  # path -> text: the state dir's other ledgers
    images: list[tuple[str, str, str]] = field(default_factory=list)  # (repository, tag, digest)
    model_files: dict[str, int] = field(default_factory=dict)  # name -> size, top level of the model dir
    model_shards: list[str] = field(default_factory=list)  # shards listed by model.safetensors.index.json
    model_incomplete: list[str] = field(default_factory=list)  # hf's *.incomplete partial downloads
    dirs: dict[str, tuple[str, str, str] | None] = field(default_factory=dict)  # path -> (user, group, mode)
    units: dict[str, tuple[str, str]] = field(default_factory=dict)  # unit -> (is-active, is-enabled)
    service_unit: ServiceUnit | None = None
    running: RunningService = field(default_factory=RunningService)
    health_code: str | None = None
    served_models: list[tuple[str, int | None]] | None = None  # /v1/models: (id, max_model_len)
    cache_config: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info labels, when reported

    # --- derived ----------------------------------------------------------------------------------------
    def installed(self, package: str) -> bool:
        return package in self.packages

    def unit_active(self, unit: str) -> bool:
        return self.units.get(unit, ("", ""))[0] == "active"

    def unit_enabled(self, unit: str) -> bool:
        return self.units.get(unit, ("", ""))[1] == "enabled"

    def has_image_digest(self, ref: str) -> bool:
        """Is `repo@sha256:...` present locally?"""
        repo, _, digest = ref.partition("@")
        return any(r == repo and d == digest for r, _, d in self.images)

    @property
    def nvidia_runtime(self) -> bool:
        runtimes = (self.daemon_json or {}).get("runtimes")
        return isinstance(runtimes, dict) and "nvidia" in runtimes


def snapshot_command(paths: Paths) -> str:
    q = shlex.quote

    def section(name: str) -> str:
        # Leading newline: a file without a final newline (json.dump writes none) must not swallow the marker.
        return f"printf '\\n{MARK}{name}\\n'"

    timed_out = "|".join(map(str, TIMED_OUT))

    def nvidia(name: str, query: str, answered: str = "") -> str:
        # rc and stderr are kept: a broken driver must surface as a message, not as "no GPUs".
        # After a timeout the driver is wedged: skip the other queries (each would wait as long again).
        # answered: shell run when the query exited 0, its output in $g.
        return (f"{section(name)}; if [ $nv = 1 ]; then g=$($t {query} 2>&1); r=$?; "
                f"printf '%s\\n@@rc %s\\n' \"$g\" \"$r\"; case $r in {timed_out}) nv=0;; 0) {answered};; esac; fi")

    def cat(file: str, then: str = "") -> str:
        # A small file (a shell word: a quoted path or "$f") printed with shell builtins (one program less than
        # cat); `|| [ -n ... ]` keeps a last line without a newline. then: more shell run on each line ($l).
        return (f"while IFS= read -r l || [ -n \"$l\" ]; do printf '%s\\n' \"$l\"; {then}done 2>/dev/null "
                f"< {file}")

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
    cat_each_ledger = cat('"$f"')
    lines = [
        "export LC_ALL=C",
        # A newline, for cutting systemctl's output with the shell's own ${...%%...} (printf is a builtin).
        "nl=$(printf '\\n.'); nl=${nl%.}",
        # -k: a program that ignores SIGTERM (nvidia-smi stuck in the kernel) is killed 2 s later.
        f"t='timeout -k 2 {COMMAND_TIMEOUT_S}'; command -v timeout >/dev/null 2>&1 || t=",
        "nv=0; command -v nvidia-smi >/dev/null 2>&1 && nv=1",
        f"{section('os')}; {cat(q('/etc/os-release'))}",
        f"{section('arch')}; dpkg --print-architecture 2>/dev/null || uname -m",
        f"{section('nvidia_smi')}; echo $nv",
        # The GPU query's output is kept ($g) for its first row's driver_version (the 7th field: GPU_FIELDS).
        "gd=; " + nvidia("gpus", QUERY_GPUS, answered="gd=${g%%\"$nl\"*}; gd=${gd#*, *, *, *, *, *, }; gd=${gd%%,*}; "
                          "case $gd in ''|*[!0-9.]*) gd=;; esac"),
        *driver_lines(paths.nvidia_version_file, nvidia("driver", QUERY_VERSION)),
        f"{section('daemon_json')}; dr=; {cat(q(DAEMON_JSON), 'case $l in *data-root*) dr=1;; esac; ')}",
        # Docker keeps images under data-root; read it without needing a JSON parser or a running daemon (sed only
        # when a line names it: most files do not).
        "root=; [ -n \"$dr\" ] && "
        f"root=$(sed -n 's/.*\"data-root\"[[:space:]]*:[[:space:]]*\"\\([^\"]*\\)\".*/\\1/p' {q(DAEMON_JSON)} 2>/dev/null)",
        # df of the nearest existing ancestor of each place (one df for both).
        f"d=${{root:-/var/lib/docker}}; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; m={q(paths.models_dir)}; "
        "while [ ! -e \"$m\" ]; do m=$(dirname \"$m\"); done",
        # df hangs on a dead network mount. Its 4th column is the free KiB (the shell's read splits the rows).
        f"{section('free')}; $t df -Pk \"$d\" \"$m\" | {{ read -r _; read -r _ _ _ a _; read -r _ _ _ b _; "
        "echo \"docker $d $a\"; echo \"models $m $b\"; }",
        f"{section('packages')}; dpkg-query -W -f='${{Package}} ${{db:Status-Abbrev}} ${{Version}}\\n' "
        f"{' '.join(PACKAGES)} 2>/dev/null",
        f"{section('files')}; sha256sum {files} 2>/dev/null",  # a missing file is simply not listed
        # A marker line first: an empty ledger file is corrupt, a missing one is a host gpufleet never converged.
        f"{section('state')}; [ -f {q(paths.ledger_path)} ] && echo @@present && {cat(q(paths.ledger_path))}",
        # The other services' ledgers: a renamed vllm_service finds its committed version (and old unit) there.
        f"{section('other_ledgers')}; for f in {q(posixpath.dirname(paths.ledger_path))}/*.json; do "
        f"[ -f \"$f\" ] && [ \"$f\" != {q(paths.ledger_path)} ] && printf '\\n{MARK}ledger %s\\n' \"$f\" && {cat_each_ledger}; "
        "done",
        f"{section('images')}; {no_curl} $t docker images --digests --no-trunc "
        "--format '{{.Repository}}|{{.Tag}}|{{.Digest}}' 2>/dev/null",
        # One find for the top-level files and hf's partial downloads (any depth), one awk for the shards the index
        # names (process() sorts them and keeps the first partial downloads).
        f"{section('model')}; if [ -d {model_dir} ]; then cd {model_dir} && "
        "find . \\( -path '*huggingface/download*' -name '*.incomplete' -printf 'incomplete %p\\n' \\) -o "
        "\\( -path './*' ! -path './*/*' -type f -printf '%f %s\\n' \\) 2>/dev/null; "
        "[ -f model.safetensors.index.json ] && awk '{ while (match($0, /\"[^\"]*\\.safetensors\"/)) { "
        "s[substr($0, RSTART + 1, RLENGTH - 2)] = 1; $0 = substr($0, RSTART + RLENGTH) } } "
        "END { for (n in s) print \"shard \" n }' model.safetensors.index.json; cd /; fi",
        f"{section('dirs')}; stat -c '%U %G %a %n' {dirs} 2>/dev/null",
        # systemd's view of docker.service and the service's unit, in one call (one block each, in this order: the
        # parser takes the second for the service); then, with shell builtins only, the first line of the unit
        # file systemd loaded (our header, or not) and the pins in the header of the file gpufleet writes.
        f"{section('units')}; sd=$($t systemctl show -p {' -p '.join(SYSTEMD_PROPERTIES)} docker.service {unit} "
        "2>/dev/null); printf '%s\\n' \"$sd\"",
        f"{section('service_unit')}; f=${{sd##*FragmentPath=}}; f=${{f%%\"$nl\"*}}; l=; "
        "if [ -n \"$f\" ]; then { IFS= read -r l < \"$f\"; } 2>/dev/null; printf 'FirstLine=%s\\n' \"$l\"; fi",
        # What really runs: the labelled containers (docker's API below), each with its label and its image.
        f"{section('running')}; h=; {{ read -r h; IFS= read -r h; }} < {q(unit_path(paths.service))} 2>/dev/null; "
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
        f"{section('nvidia_key')}; if command -v curl >/dev/null; then svc=${{cip:-{address}}}; "
        f"(VLLM_API_KEY=; [ -f {q(paths.env_file)} ] && . {q(paths.env_file)}; "
        "case \"$cj\" in *'\"Id\"'*) ;; *) VLLM_API_KEY= ;; esac; "
        "if [ -n \"$VLLM_API_KEY\" ]; then printf 'Authorization: Bearer %s\\n' \"$VLLM_API_KEY\"; fi) | "
        f"({keys}curl \"$@\" {docker_gets}"
        f"--next -s --max-time 3 -o /dev/null -w '%{{http_code}}\\n' \"http://$svc:{port}/health\" "
        f"--next -s --max-time 3 -H @- \"http://$svc:{port}/v1/models\" -w {next_mark('cache_config')} "
        f"--next -s --max-time 3 \"http://$svc:{port}/metrics\") 2>/dev/null | "
        f"awk '$0 == \"{MARK}cache_config\" {{ c = 1; print; next }} !c || index($0, \"{CACHE_CONFIG}{{\") == 1'; fi",
        section("end"),
    ]
    return "\n".join(lines)


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


# The service's answers come last: after the health section only these may begin (a marker in /v1/models' body that
# names any other section is not gpufleet's).
AFTER_ANSWERS = ("cache_config", "end")


def split_sections(lines: list[str]) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith(MARK):
            current = line[len(MARK):].strip()
            if "health" in sections and current not in AFTER_ANSWERS:
                raise FactProcessError(f"{SNAPSHOT_REFUSED}: a section {excerpt(current, 60)!r} inside the service's "
                                       "answers (something that answered on the host carried gpufleet's section "
                                       "marker)")
            if current in sections:
                # Every section is printed once. A second one came from something the snapshot quotes (an answer on
                # the service's port, a file): a forged ledger or checksum must never be what root acts on.
                raise FactProcessError(f"{SNAPSHOT_REFUSED}: its section {excerpt(current, 60)!r} appears twice "
                                       "(something that answered on the host or a file it read carried gpufleet's "
                                       "section marker)")
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    for lines_ in sections.values():
        while lines_ and not lines_[-1].strip():
            lines_.pop()
    if "end" not in sections:
        raise FactProcessError("host snapshot output is truncated (no end marker)")
    return sections


def _nvidia_section(lines: list[str]) -> tuple[list[str], int]:
    rc = 0
    if lines and lines[-1].startswith("@@rc "):
        rc = int(lines[-1].split()[1])
        lines = lines[:-1]
    if rc in TIMED_OUT:
        raise FactProcessError(f"nvidia-smi did not answer within {COMMAND_TIMEOUT_S} s (a wedged driver or GPU)")
    return lines, rc


def parse_snapshot(lines: list[str]) -> HostSnapshot:
    s = split_sections(lines)
    snap = HostSnapshot()
    for line in s.get("os", []):
        key, sep, value = line.partition("=")
        if sep:
            snap.os[key.strip()] = value.strip().strip('"')
    snap.arch = (s.get("arch") or [""])[0].strip()
    snap.nvidia_smi = (s.get("nvidia_smi") or ["0"])[0].strip() == "1"
    if snap.nvidia_smi:
        try:
            gpus, rc = _nvidia_section(s.get("gpus", []))
            if rc == 6 or any("No devices were found" in line for line in gpus):
                snap.gpus = []  # driver present, no GPU: the same as a GPU-less host for preflight
            else:
                snap.gpus = parse_gpus(gpus)
                if rc:
                    raise FactProcessError(f"nvidia-smi --query-gpu exited {rc}")
                if DRIVER_FILE in s:
                    snap.driver, snap.driver_from_file = parse_version(s[DRIVER_FILE]), True
                else:
                    driver = _nvidia_section(s.get("driver", []))[0]
                    snap.driver = parse_version(driver)
                    snap.driver_output = "\n".join(driver) + "\n"
        except FactProcessError as error:
            snap.nvidia_error = str(error)
    text = "\n".join(s.get("daemon_json", [])).strip()
    if text:
        try:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            snap.daemon_json = value
        except ValueError as error:
            snap.daemon_json_error = f"{DAEMON_JSON} is not valid JSON ({error})"
    for line in s.get("free", []):
        place, _, rest = line.partition(" ")
        path, _, kib = rest.rpartition(" ")  # the path may hold spaces
        if path and kib.isdigit():
            snap.free_kib[place] = int(kib)
            snap.free_path[place] = path
    for line in s.get("packages", []):
        parts = line.split()
        # "ii" = installed; "rc" (removed, config left) and "un" are not.
        if len(parts) >= 3 and parts[1] == "ii":
            snap.packages[parts[0]] = parts[2]
    for line in s.get("files", []):
        digest, _, path = line.partition(" ")
        if len(digest) == 64:
            snap.file_sha256[path.strip().lstrip("*")] = digest
    for name in ("nvidia_key", "docker_key"):
        text = "\n".join(s.get(name, [])).strip()
        if "BEGIN PGP PUBLIC KEY BLOCK" in text:
            setattr(snap, name, text + "\n")
    state = s.get("state", [])
    if state and state[0] == "@@present":
        snap.ledger_text = "\n".join(state[1:]) + "\n"
    snap.other_ledgers = {name[len("ledger "):]: "\n".join(body) + "\n" for name, body in s.items()
                          if name.startswith("ledger ")}
    snap.images = docker_images(s.get(DOCKER_IMAGES, []))
    for line in s.get("images", []):  # the docker CLI's rows (a host without curl)
        parts = line.split("|")
        if len(parts) == 3 and parts[2].startswith("sha256:"):
            snap.images.append((parts[0], parts[1], parts[2]))
    shards = set()
    for line in s.get("model", []):
        kind, _, rest = line.partition(" ")
        if kind == "shard":
            shards.add(rest)
        elif kind == "incomplete":
            if len(snap.model_incomplete) < MAX_INCOMPLETE:
                snap.model_incomplete.append(rest)
        else:
            name, _, size = line.rpartition(" ")
            if size.isdigit():
                snap.model_files[name] = int(size)
    snap.model_shards = sorted(shards)
    for line in s.get("dirs", []):
        parts = line.split(" ", 3)
        if len(parts) == 4:
            snap.dirs[parts[3]] = (parts[0], parts[1], parts[2])
    blocks = systemd_blocks(s.get("units", []))
    for block in blocks:
        snap.units[block.get("Id", "?")] = (block.get("ActiveState", ""), block.get("UnitFileState", ""))
    # The service's block (the second: docker.service comes first), completed by the lines read from its files.
    service = blocks[1] if len(blocks) > 1 else {}
    fields = {**service, **dict(line.partition("=")[::2] for line in s.get("service_unit", []) if "=" in line)}
    if fields.get("Id"):
        snap.service_unit = ServiceUnit(name=fields["Id"], load_state=fields.get("LoadState", ""),
                                        fragment_path=fields.get("FragmentPath", ""),
                                        first_line=fields.get("FirstLine", ""))
    api_containers = next((docker_containers(body, name.partition(" ")[2]) for name, body in s.items()
                           if name.startswith(DOCKER_CONTAINERS + " ")), [])
    snap.running = parse_running(s.get("running", []), service, api_containers)
    health = s.get("health", [])
    if health and health[0].strip() not in ("", "000"):
        snap.health_code = health[0].strip()
        body = "\n".join(health[1:]).strip()
        try:
            snap.served_models = served_models(body.encode())
        except ValueError:
            snap.served_models = None
    try:
        snap.cache_config = parse_metrics("\n".join(s.get("cache_config", [])) + "\n").cache_config
    except ValueError:
        snap.cache_config = {}
    return snap


def systemd_blocks(lines: list[str]) -> list[dict[str, str]]:
    """`systemctl show` of several units: one block of Key=value lines per unit, blank-line separated."""
    blocks: list[dict[str, str]] = []
    block: dict[str, str] = {}
    for line in [*lines, ""]:
        key, sep, value = line.partition("=")
        if sep:
            block[key.strip()] = value.strip()
        elif block:
            blocks.append(block)
            block = {}
    return blocks


def _json_list(lines: list[str]) -> list[dict[str, Any]]:
    """An Engine API listing; [] when there is none (the daemon is down, did not answer in time, or refused)."""
    try:
        value = json.loads("\n".join(lines))
    except ValueError:
        return []
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def docker_images(lines: list[str]) -> list[tuple[str, str, str]]:
    """/images/json as the (repository, tag, digest) rows `docker images --digests` prints, the rows with a
    registry digest only: each digest once per tag of its repository, or with tag "<none>" when the image has no
    tag there (pulled by digest only). The daemon lists both in docker's short form, as the CLI shows them.

    >>> docker_images(['[{"RepoTags": ["reg:5000/v:nightly"], "RepoDigests": ["reg:5000/v@sha256:ab", "w@sha256:cd"]}]'])
    [('reg:5000/v', 'nightly', 'sha256:ab'), ('w', '<none>', 'sha256:cd')]
    """
    rows = []
    for image in _json_list(lines):
        tags: dict[str, list[str]] = {}
        for name in image.get("RepoTags") or []:
            repository, _, tag = str(name).rpartition(":")
            if repository and tag and "/" not in tag:  # "/": a registry port, not a tag
                tags.setdefault(repository, []).append(tag)
        for name in image.get("RepoDigests") or []:
            repository, _, digest = str(name).partition("@")
            if repository and digest.startswith("sha256:"):  # "<none>@<none>": no digest
                rows += [(repository, tag, digest) for tag in tags.get(repository, ["<none>"])]
    return rows


def docker_containers(lines: list[str], label_key: str) -> list[tuple[str, str]]:
    """/containers/json (running containers, filtered by the label) as (label value, image): what
    `docker ps --no-trunc --format '{{.Label "<key>"}}|{{.Image}}'` prints for them."""
    return [(str((c.get("Labels") or {}).get(label_key, "")), str(c.get("Image") or "<no image>"))
            for c in _json_list(lines)]


def parse_running(lines: list[str], unit: dict[str, str] | None = None,
                  containers: list[tuple[str, str]] | None = None) -> RunningService:
    """unit: systemd's properties of the service's unit; the section's own lines (Header, and Container from the
    docker CLI on a host without curl) add to them, and containers: docker's API's (label, image) of each."""
    fields: dict[str, str] = dict(unit or {})
    containers = list(containers or [])
    for line in lines:
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "Container":
            label, _, image = value.partition("|")
            containers.append((label.strip(), image.strip()))
        else:
            fields[key] = value.strip()
    pins = UNIT_PINS.match(fields.get("Header", ""))
    return RunningService(
        active_state=fields.get("ActiveState", ""), sub_state=fields.get("SubState", ""),
        need_daemon_reload=fields.get("NeedDaemonReload") == "yes",
        restarts=int(fields["NRestarts"]) if fields.get("NRestarts", "").isdigit() else 0,
        unit_spec_hash=pins["spec"] if pins else None, unit_image=pins["image"] if pins else None,
        containers=tuple(containers),
    )


class GpufleetHost(FactBase[HostSnapshot]):
    """Everything the deploy decides from, in one command (run it with _sudo=True: it reads root files)."""

    def command(self, paths: Paths) -> str:
        return snapshot_command(paths)

    @staticmethod
    def default() -> HostSnapshot:
        return HostSnapshot()

    def process(self, output: list[str]) -> HostSnapshot:
        return parse_snapshot(output)
