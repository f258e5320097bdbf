#!/usr/bin/python3
"""Stand-in `nvidia-container-runtime`: like the real one, an OCI runtime that adds NVIDIA's prestart hook to the
bundle's config.json when the container asks for GPUs (NVIDIA_VISIBLE_DEVICES), then hands over to runc.

On a test machine that is itself a container, it clamps rlimits it may not raise and drops capabilities outside its
bounding set, with a warning (docs/test-hosts.md)."""

import json
import os
import resource
import sys
from typing import Any

HOOK = "/usr/bin/nvidia-container-runtime-hook"


def add_hook(spec: dict[str, Any]) -> None:
    env = dict(e.split("=", 1) for e in spec.get("process", {}).get("env", []) if "=" in e)
    if env.get("NVIDIA_VISIBLE_DEVICES", "void") in ("void", ""):
        return
    prestart = spec.setdefault("hooks", {}).setdefault("prestart", [])
    if any(h.get("path") == HOOK for h in prestart):
        return  # docker's --gpus driver already put it there
    prestart.insert(0, {"path": HOOK, "args": [HOOK, "prestart"]})


def clamp_rlimits(spec: dict[str, Any]) -> None:
    infinity = (1 << 64) - 1
    for limit in spec.get("process", {}).get("rlimits", []):
        kind = getattr(resource, limit["type"], None)
        if kind is None:
            continue
        want_soft, want_hard = (resource.RLIM_INFINITY if v >= infinity else v for v in (limit["soft"], limit["hard"]))
        want = (want_soft, want_hard)
        try:
            resource.setrlimit(kind, want)  # allowed here means allowed for runc too
        except (ValueError, OSError):
            _, hard = resource.getrlimit(kind)
            cap = infinity if hard == resource.RLIM_INFINITY else hard
            limit["soft"], limit["hard"] = min(limit["soft"], cap), min(limit["hard"], cap)
            print(
                f"nvidia-container-runtime (stand-in): {limit['type']} clamped to {cap}: this machine may not raise it",
                file=sys.stderr,
            )


# linux/capability.h order: bit n of CapBnd is CAPABILITIES[n]
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
]


def clamp_capabilities(spec: dict[str, Any]) -> None:
    with open("/proc/self/status") as f:
        bounding = int(next(line.split()[1] for line in f if line.startswith("CapBnd:")), 16)
    missing = {name for bit, name in enumerate(CAPABILITIES) if not bounding >> bit & 1}
    caps = spec.get("process", {}).get("capabilities", {})
    dropped = set()
    for kind, names in caps.items():
        dropped |= set(names) & missing
        caps[kind] = [n for n in names if n not in missing]
    if dropped:
        print(
            f"nvidia-container-runtime (stand-in): dropped {','.join(sorted(dropped))}: this machine lacks them",
            file=sys.stderr,
        )


def main(argv: list[str]) -> None:
    if "create" in argv:
        bundle = next((argv[i + 1] for i, a in enumerate(argv) if a in ("--bundle", "-b")), os.getcwd())
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            spec = json.load(f)
        add_hook(spec)
        clamp_rlimits(spec)
        clamp_capabilities(spec)
        with open(path, "w") as f:
            json.dump(spec, f)
    os.execvp("runc", ["runc", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
