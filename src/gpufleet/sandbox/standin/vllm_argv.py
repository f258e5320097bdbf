"""The stand-in `vllm serve`'s argv, parsed with the real `vllm serve --help=all`'s flags, and which vLLM it plays."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

# Beside this file in the image, the package's table in a checkout.
_HERE = Path(__file__).resolve()
FLAGS_FILE = Path(
    os.environ.get("STANDIN_FLAGS")
    or next(
        p
        for p in (_HERE.with_name("vllm_flags.json"), _HERE.parents[2] / "data" / "vllm-serve-flags.json")
        if p.exists()
    )
)
VERSION = os.environ.get("STANDIN_VLLM_VERSION", "0.32.0")
_TYPES = {"int": int, "float": float, "str": str}


def build_parser(spec: dict[str, Any], unknown: set[str]) -> argparse.ArgumentParser:
    # vLLM's FlexibleArgumentParser does not accept abbreviated flags either.
    parser = argparse.ArgumentParser(prog=spec["prog"], usage=spec["usage"], allow_abbrev=False, add_help=False)
    parser.add_argument(spec["positional"], nargs="?", default=None)
    for flag in spec["flags"]:
        names = [n for n in flag["names"] if not n.startswith("--no-")]
        if set(names) & unknown:
            continue
        if flag["kind"] == "flag":
            parser.add_argument(*names, action="store_true")
        elif flag["kind"] == "bool":
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=None)
        else:
            kw: dict[str, Any] = {"type": _TYPES[flag["type"]], "default": None}
            if flag["choices"]:
                kw["choices"] = flag["choices"]
            if flag["nargs"]:
                kw["nargs"] = flag["nargs"]
            parser.add_argument(*names, **kw)
    return parser


def normalise(argv: list[str]) -> list[str]:
    """vLLM's argv conveniences: -O3 and underscores in flag names."""
    out = []
    for arg in argv:
        if re.fullmatch(r"-O\d", arg):
            out += ["--optimization-level", arg[2:]]
        elif arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            key, sep, value = arg.partition("=")
            out.append(key.replace("_", "-") + sep + value)
        else:
            out.append(arg)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    spec = json.loads(FLAGS_FILE.read_text())
    unknown = {f for f in os.environ.get("STANDIN_UNKNOWN_FLAGS", "").split(",") if f}
    parser = build_parser(spec, unknown)
    if any(a == "-h" or a.startswith("--help") for a in argv):
        parser.print_usage()
        print("\n".join(", ".join(f["names"]) for f in spec["flags"] if not set(f["names"]) & unknown))
        sys.exit(0)
    argv = normalise(argv)
    extras = unrecognized(argv, set(parser._option_string_actions))
    if extras:
        # Listed with their values, as vLLM's top-level parser words it.
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return parser.parse_args(argv)


def unrecognized(argv: list[str], known: set[str]) -> list[str]:
    """The unknown options and their values, as argparse lists them for vLLM."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and arg.split("=", 1)[0] not in known:
            out.append(arg)
            value = argv[i + 1] if i + 1 < len(argv) else ""
            if "=" not in arg and value and not value.startswith("-"):
                out.append(value)
    return out


def human_int(value: str | None) -> int | None:
    """--max-model-len accepts 1k / 2M / 225000 like vLLM's human_readable_int."""
    if value is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", value)
    if not m:
        fail(
            2,
            f"usage: vllm serve [model_tag] [options]\nvllm serve: error: argument --max-model-len: "
            f"invalid human_readable_int value: '{value}'",
        )
    scale = {"": 1, "k": 1000, "K": 1024, "m": 10**6, "M": 1024**2, "g": 10**9, "G": 1024**3}[m.group(2)]
    return int(float(m.group(1)) * scale)


def fail(rc: int, message: str) -> NoReturn:
    print(message, file=sys.stderr, flush=True)
    sys.exit(rc)
