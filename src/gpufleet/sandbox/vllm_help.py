"""Turn the real `vllm serve --help=all` text into the compact flag table the stand-in server parses argv with.

    python -m gpufleet.sandbox.vllm_help tests/fixtures/vllm/serve-help-all.txt > src/gpufleet/sandbox/standin/vllm_flags.json

The output is committed (the stand-in is stdlib-only and has no help text in the image); a unit test regenerates
it from the recording and compares, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

FLAGS_JSON = Path(__file__).parent / "standin" / "vllm_flags.json"
# An option line of argparse's help: two spaces, then option strings (with metavars) until two spaces or EOL.
_OPTION = re.compile(r"^  (-{1,2}[\w.-].*?)(?:  +(.*))?$")


def parse_help(text: str) -> dict:
    """{"flags": [{"names", "kind", "choices", "nargs", "type", "default"}], "positional": "model_tag"}."""
    flags, current = [], None
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


def _option(spec: str) -> dict | None:
    names, metavars = [], []
    for part in re.split(r", (?=-)", spec):
        tokens = part.split(" ", 1)
        if not tokens[0].startswith("-"):
            return None
        names.append(tokens[0])
        if len(tokens) > 1:
            metavars.append(tokens[1])
    meta = metavars[0] if metavars else None
    entry: dict = {"names": names, "choices": None, "nargs": None}
    if meta is None:
        entry["kind"] = "bool" if any(n.startswith("--no-") for n in names) else "flag"
        return entry
    entry["kind"] = "value"
    if meta.startswith("{"):
        entry["choices"] = meta.strip("{}").split(",")
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


def _type(flag: dict) -> str:
    """int/float where the recorded default is one (argparse then rejects `--port abc` like vLLM); else str."""
    if flag["kind"] != "value" or flag["choices"] or flag["nargs"]:
        return "str"
    d = flag["default"]
    if d is not None and re.fullmatch(r"-?\d+", d):
        return "int"
    if d is not None and re.fullmatch(r"-?\d+\.\d*(e-?\d+)?", d):
        return "float"
    return "str"


def main(argv: list[str]) -> int:
    spec = parse_help(Path(argv[0]).read_text())
    json.dump(spec, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
