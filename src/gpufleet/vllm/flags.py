"""What `vllm serve` accepts, from a recorded `--help=all` compiled into one table (docs/test-hosts.md). Regenerate:

python -m gpufleet.vllm.flags tests/fixtures/vllm/serve-help-all.txt > src/gpufleet/data/vllm-serve-flags.json
"""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

FLAGS_JSON = Path(__file__).resolve().parents[1] / "data" / "vllm-serve-flags.json"
# Two spaces, then option strings and metavars until two spaces or the end.
_OPTION = re.compile(r"^  (-{1,2}[\w.-].*?)(?:  +(.*))?$")
FlagEntry = dict[str, Any]


@dataclass(frozen=True)
class FlagInfo:
    """One `vllm serve` option, as settings validation needs it."""

    name: str  # without dashes, e.g. "kv-cache-dtype"
    takes_value: bool
    negatable: bool  # --no-<name> exists
    choices: tuple[str, ...] | None  # None: any value
    open_choices: bool  # a plugin may register other names
    value_type: str = "str"


def parse_help(text: str) -> dict[str, Any]:
    """{"flags": [{"names", "kind", "choices", "open", "nargs", "type", "default"}], ...}; kind: flag, bool or value."""
    flags: list[FlagEntry] = []
    current: FlagEntry | None = None
    for line in text.splitlines():
        m = _OPTION.match(line)
        if m and not line.startswith("   "):
            current = _option(m.group(1))
            if current:
                flags.append(current)
            rest = m.group(2) or ""
        else:
            rest = line.strip()
        if current is not None:
            current["_help"] = current.get("_help", "") + " " + rest
    for f in flags:
        f["default"] = _default(f.pop("_help"))
        f["type"] = _type(f)
    return {
        "prog": "vllm serve",
        "usage": "vllm serve [model_tag] [options]",
        "positional": "model_tag",
        "flags": [f for f in flags if f["names"] != ["-h", "--help"]],
    }


def _option(spec: str) -> FlagEntry | None:
    names: list[str] = []
    metavars: list[str] = []
    for part in re.split(r", (?=-)", spec):
        tokens = part.split(" ", 1)
        if not tokens[0].startswith("-"):
            return None
        names.append(tokens[0])
        if len(tokens) > 1:
            metavars.append(tokens[1])
    meta = metavars[0] if metavars else None
    entry: FlagEntry = {"names": names, "choices": None, "open": False, "nargs": None}
    if meta is None:
        entry["kind"] = "bool" if any(n.startswith("--no-") for n in names) else "flag"
        return entry
    entry["kind"] = "value"
    if meta.startswith("{"):
        inside, _, after = meta[1:].partition("}")
        entry["choices"] = inside.split(",")
        # "{hermes,...} or name registered in --tool-parser-plugin"
        entry["open"] = " or " in after
    elif meta.startswith("['"):
        entry["choices"] = ast.literal_eval(meta)
    elif meta.startswith("[") and meta.endswith("]"):
        entry["nargs"] = "?"
    if meta.endswith("...]"):
        entry["nargs"] = "+"
    return entry


def _default(help_text: str) -> str | None:
    m = re.search(r"\(default:\s*(.*?)\)\s*$", " ".join(help_text.split()))
    return m.group(1) if m else None


def _type(flag: FlagEntry) -> str:
    """int or float where the recorded default is one, so `--port abc` is rejected as vLLM does."""
    if flag["kind"] != "value" or flag["choices"] or flag["nargs"]:
        return "str"
    d = flag["default"]
    if d is not None and re.fullmatch(r"-?\d+", d):
        return "int"
    if d is not None and re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", d):
        return "float"
    return "str"


def _long_name(names: list[str]) -> str | None:
    return next((n[2:] for n in names if n.startswith("--") and not n.startswith("--no-")), None)


@cache
def known_flags() -> dict[str, FlagInfo]:
    """{long name: FlagInfo} from the table shipped with the package."""
    table = json.loads(FLAGS_JSON.read_text())
    flags = {}
    for f in table["flags"]:
        name = _long_name(f["names"])
        if name:
            flags[name] = FlagInfo(
                name,
                takes_value=f["kind"] == "value",
                negatable=f["kind"] == "bool",
                choices=tuple(f["choices"]) if f["choices"] else None,
                open_choices=f["open"],
                value_type=f.get("type", "str"),
            )
    return flags


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    json.dump(parse_help(Path(sys.argv[1]).read_text()), sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
