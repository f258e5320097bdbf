"""Stand-in of Docker's apt repo (download.docker.com/linux), with its real layout, package names and signed InRelease.

Only the packaging is a stand-in: the binaries are Debian's own, from the local mirror (docs/test-hosts.md).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import time
from pathlib import Path

from gpufleet.sandbox import cache
from gpufleet.sandbox.apt_signing import ThrowawayKey
from gpufleet.sandbox.procs import SandboxError, log, run
from gpufleet.sandbox.rootfs import SUITE

OS_ID = "debian"
OS_VERSION_ID = "12"  # bookworm, as Docker's version strings name it
COMPONENT = "stable"
# The mirror's packages whose binaries the repo's debs carry.
SOURCES = ("docker.io", "containerd", "runc", "tini")
MAINTAINER = "gpufleet sandbox <sandbox@gpufleet.invalid>"

# Docker's units of the 20.10 line, as the binaries are.
DOCKER_SERVICE = """\
[Unit]
Description=Docker Application Container Engine
Documentation=https://docs.docker.com
After=network-online.target docker.socket firewalld.service containerd.service
Wants=network-online.target
Requires=docker.socket containerd.service

[Service]
Type=notify
# the default is not to use systemd for cgroups because the delegate issues still
# exists and systemd currently does not support the cgroup feature set required
# for containers run by docker
ExecStart=/usr/bin/dockerd -H fd:// --containerd=/run/containerd/containerd.sock
ExecReload=/bin/kill -s HUP $MAINPID
TimeoutSec=0
RestartSec=2
Restart=always
StartLimitBurst=3
StartLimitInterval=60s
LimitNOFILE=infinity
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
Delegate=yes
KillMode=process
OOMScoreAdjust=-500

[Install]
WantedBy=multi-user.target
"""
DOCKER_SOCKET = """\
[Unit]
Description=Docker Socket for the API

[Socket]
ListenStream=/run/docker.sock
SocketMode=0660
SocketUser=root
SocketGroup=docker

[Install]
WantedBy=sockets.target
"""
# containerd.io's config turns off the CRI plugin.
CONTAINERD_CONFIG = '#   Docker\'s containerd.io default: only what dockerd needs.\ndisabled_plugins = ["cri"]\n'


def _systemd_scripts(units: str, first_install: str = "") -> dict[str, str]:
    """Maintainer scripts as debhelper generates them for packaged units."""
    return {
        "postinst": f"""#!/bin/sh
set -e
if [ "$1" = configure ]; then
{first_install}    for unit in {units}; do
        deb-systemd-helper unmask "$unit" >/dev/null || true
        if deb-systemd-helper --quiet was-enabled "$unit"; then
            deb-systemd-helper enable "$unit" >/dev/null || true
        else
            deb-systemd-helper update-state "$unit" >/dev/null || true
        fi
    done
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        deb-systemd-invoke start {units} >/dev/null || true
    fi
fi
""",
        "prerm": f"""#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    deb-systemd-invoke stop {units} >/dev/null || true
fi
""",
        "postrm": f"""#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
if [ "$1" = purge ] && [ -x /usr/bin/deb-systemd-helper ]; then
    deb-systemd-helper purge {units} >/dev/null || true
fi
""",
    }


# docker-ce's own postinst creates the socket's group.
DOCKER_GROUP = """    if [ -z "$2" ] && ! getent group docker >/dev/null; then
        groupadd --system docker
    fi
"""

PLUGIN = """#!/bin/sh
# {name}: a stand-in in the gpufleet sandbox (the machine's Debian mirror has no {what}); gpufleet never uses it.
if [ "$1" = docker-cli-plugin-metadata ]; then
    printf '{{"SchemaVersion":"0.1.0","Vendor":"gpufleet sandbox (stand-in)","Version":"v0.0.0",'
    printf '"ShortDescription":"{what} (stand-in: not available in the sandbox)"}}\\n'
    exit 0
fi
echo "docker {cmd}: not available in the gpufleet sandbox (its {name} package is a stand-in)" >&2
exit 1
"""


def _source_debs(mirror: Path) -> dict[str, Path]:
    found = {}
    for name in SOURCES:
        debs = sorted(mirror.glob(f"{name}_*.deb"))
        if not debs:
            raise SandboxError(
                f"the Debian mirror {mirror} has no {name} package to build the Docker repo stand-in from"
            )
        found[name] = debs[-1]
    return found


def _key(sources: dict[str, Path]) -> str:
    h = hashlib.sha256(SUITE.encode())
    for name, deb in sorted(sources.items()):
        h.update(f"{name}={deb.name}:{deb.stat().st_size};".encode())
    for module in ("docker_repo.py", "apt_signing.py"):
        h.update((Path(__file__).parent / module).read_bytes())
    return h.hexdigest()[:12]


def upstream_version(deb_version: str) -> str:
    """20.10.24+dfsg1-1+deb12u1+b6 -> 20.10.24."""
    return re.split(r"[+~-]", deb_version.split(":", 1)[-1], maxsplit=1)[0]


def ensure_repo(cache_dir: Path, mirror: Path) -> Path:
    """The directory to serve at <mirror>/docker, built once per source debs and builder source."""
    sources = _source_debs(mirror)
    arch = sources["docker.io"].stem.rsplit("_", 1)[1]
    root = cache_dir / f"docker-repo-{_key(sources)}"
    if cache.is_done(root):
        return root
    # Fleets starting at once share this entry: one builds, the others wait.
    with cache.building(cache_dir / f".{root.name}.lock"):
        if not cache.is_done(root):
            _build_repo(cache_dir, root, sources, arch)
    return root


def _build_repo(cache_dir: Path, root: Path, sources: dict[str, Path], arch: str) -> None:
    t0 = time.monotonic()
    log.info("building the stand-in Docker repo from %s", ", ".join(d.name for d in sources.values()))
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    debian = tmp / "linux" / OS_ID
    pool = debian / "dists" / SUITE / "pool" / COMPONENT / arch
    pool.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as work:
        _build_packages(Path(work), sources, arch, pool)
    # The private key stays out of the served tree.
    with ThrowawayKey(
        root.with_name(root.name + ".gnupg"),
        "Docker repo stand-in (throwaway, gpufleet sandbox) <sandbox@gpufleet.invalid>",
    ) as key:
        (debian / "gpg").write_text(key.armored_public_key())
        _index(debian, arch)
        key.sign_release(debian / "dists" / SUITE)
    log.info("Docker repo stand-in built in %.1fs", cache.publish(tmp, root, t0))


def _deb_field(deb: Path, field: str) -> str:
    return run(["dpkg-deb", "-f", str(deb), field]).stdout.strip()


def _build_packages(work: Path, sources: dict[str, Path], arch: str, pool: Path) -> None:
    src = {}
    for name, deb in sources.items():
        src[name] = work / "src" / name
        src[name].mkdir(parents=True)
        run(["dpkg-deb", "-x", str(deb), str(src[name])])
    docker_version = (
        f"5:{upstream_version(_deb_field(sources['docker.io'], 'Version'))}-1~{OS_ID}.{OS_VERSION_ID}~{SUITE}"
    )
    containerd_version = f"{upstream_version(_deb_field(sources['containerd'], 'Version'))}-1"
    plugin_version = f"0.0.0-1~{OS_ID}.{OS_VERSION_ID}~{SUITE}"
    engine_conflicts = "docker (<< 1.5~), docker-engine, docker.io"

    def package(
        name: str,
        version: str,
        files: dict[str, Path | str],
        control: dict[str, str],
        description: str,
        scripts: dict[str, str] | None = None,
        conffiles: tuple[str, ...] = (),
        origin: str = "Repackaged by the gpufleet sandbox from Debian's binaries under Docker's package name.",
    ) -> None:
        pkg = work / "pkg" / name
        for dest, content in files.items():
            target = pkg / dest
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copy(content, target)  # docker-init is tini-static itself, as in docker-ce
            else:
                target.write_text(content)
                target.chmod(0o755 if content.startswith("#!") else 0o644)
        (pkg / "DEBIAN").mkdir(parents=True)
        size_kib = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file()) // 1024 + 1
        fields = {
            "Package": name,
            "Version": version,
            "Architecture": arch,
            "Maintainer": MAINTAINER,
            "Installed-Size": str(size_kib),
            "Section": "admin",
            "Priority": "optional",
            "Homepage": "https://www.docker.com",
            **control,
        }
        text = "".join(f"{k}: {v}\n" for k, v in fields.items() if v)
        (pkg / "DEBIAN/control").write_text(f"{text}Description: {description}\n {origin}\n")
        for script, body in (scripts or {}).items():
            (pkg / "DEBIAN" / script).write_text(body)
            (pkg / "DEBIAN" / script).chmod(0o755)
        if conffiles:
            (pkg / "DEBIAN/conffiles").write_text("".join(f"/{c}\n" for c in conffiles))
        # Read over loopback: speed over size.
        run(
            [
                "dpkg-deb",
                "-Zgzip",
                "-z1",
                "--root-owner-group",
                "--build",
                str(pkg),
                str(pool / f"{name}_{version.split(':', 1)[-1]}_{arch}.deb"),
            ]
        )

    containerd, runc, docker, tini = src["containerd"], src["runc"], src["docker.io"], src["tini"]
    package(
        "containerd.io",
        containerd_version,
        {
            **{f"usr/bin/{b.name}": b for b in sorted((containerd / "usr/bin").iterdir())},
            "usr/bin/runc": runc / "usr/sbin/runc",
            "lib/systemd/system/containerd.service": (containerd / "lib/systemd/system/containerd.service").read_text(),
            "etc/containerd/config.toml": CONTAINERD_CONFIG,
        },
        {
            "Depends": "libc6 (>= 2.34), libseccomp2 (>= 2.5.0)",
            "Provides": "containerd, runc",
            "Conflicts": "containerd, runc",
            "Replaces": "containerd, runc",
            "Homepage": "https://containerd.io",
        },
        "An open and reliable container runtime",
        scripts=_systemd_scripts("containerd.service"),
        conffiles=("etc/containerd/config.toml",),
    )
    package(
        "docker-ce-cli",
        docker_version,
        {"usr/bin/docker": docker / "usr/bin/docker"},
        {
            "Depends": "libc6 (>= 2.34)",
            "Recommends": "docker-buildx-plugin, docker-compose-plugin",
            "Conflicts": engine_conflicts,
            "Replaces": "docker-ce (<< 5:0)",
            "Breaks": "docker-ce (<< 5:0)",
        },
        "Docker CLI: the open-source application container engine",
    )
    package(
        "docker-ce",
        docker_version,
        {
            "usr/bin/dockerd": docker / "usr/sbin/dockerd",
            "usr/bin/docker-proxy": docker / "usr/sbin/docker-proxy",
            "usr/bin/docker-init": tini / "usr/bin/tini-static",
            "lib/systemd/system/docker.service": DOCKER_SERVICE,
            "lib/systemd/system/docker.socket": DOCKER_SOCKET,
        },
        {
            "Pre-Depends": "init-system-helpers (>= 1.54~)",
            "Depends": "containerd.io (>= 1.6), docker-ce-cli, iptables, libc6 (>= 2.34), "
            "libdevmapper1.02.1 (>= 2:1.02.97), libseccomp2 (>= 2.3.0), libsystemd0",
            "Recommends": "apparmor, ca-certificates, docker-ce-rootless-extras, git, pigz, procps, xz-utils",
            "Conflicts": engine_conflicts,
            "Replaces": "docker-engine",
        },
        "Docker: the open-source application container engine",
        scripts=_systemd_scripts("docker.socket docker.service", first_install=DOCKER_GROUP),
    )
    for name, what, cmd in (
        ("docker-buildx-plugin", "Docker Buildx", "buildx"),
        ("docker-compose-plugin", "Docker Compose v2", "compose"),
    ):
        package(
            name,
            plugin_version,
            {f"usr/libexec/docker/cli-plugins/docker-{cmd}": PLUGIN.format(name=name, what=what, cmd=cmd)},
            {"Enhances": "docker-ce-cli"},
            f"{what} cli plugin (gpufleet sandbox stand-in)",
            origin="A script that answers the CLI's plugin metadata call and says it is a stand-in.",
        )


def _index(debian: Path, arch: str) -> None:
    """Packages per component/arch and the signed-over Release, with Docker's fields."""
    dists = debian / "dists" / SUITE
    binary = dists / COMPONENT / f"binary-{arch}"
    binary.mkdir(parents=True)
    # From debian/, Filename fields are relative to the repo base, as in Docker's.
    packages = run(["apt-ftparchive", "packages", f"dists/{SUITE}/pool/{COMPONENT}/{arch}"], cwd=debian).stdout
    (binary / "Packages").write_text(packages)
    run(["gzip", "-kf", "Packages"], cwd=binary)
    (binary / "Release").write_text(
        f"Archive: {SUITE}\nComponent: {COMPONENT}\nOrigin: Docker\nLabel: Docker CE\nArchitecture: {arch}\n"
    )
    fields = {
        "Origin": "Docker",
        "Label": "Docker CE",
        "Suite": SUITE,
        "Codename": SUITE,
        "Architectures": arch,
        "Components": COMPONENT,
        "Description": f"Docker CE packages for Debian {SUITE} (gpufleet sandbox stand-in)",
    }
    options = [a for k, v in fields.items() for a in ("-o", f"APT::FTPArchive::Release::{k}={v}")]
    release = run(["apt-ftparchive", *options, "release", "."], cwd=dists).stdout
    (dists / "Release").write_text(release)
