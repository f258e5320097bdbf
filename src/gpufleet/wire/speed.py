"""A version's speed figures on one host, and the rule that holds a new version to the old one (docs/verify.md)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from typing import Any

# figure -> (label, unit, whether more is faster)
FIGURES: dict[str, tuple[str, str, bool]] = {
    "prefill_tokens_per_s": ("prefill", "tokens/s", True),
    "cached_ttft_s": ("cached TTFT", "s", False),
    "decode_tokens_per_s": ("decode", "tokens/s", True),
    "batch_tokens_per_s": ("batch", "tokens/s", True),
}
WORKLOAD = ("prompt_tokens", "decode_tokens", "concurrency")
PROMPT_SLACK = 0.1  # prompts of one workload differ by their seed's few tokens


@dataclass(frozen=True)
class SpeedFigures:
    """Each figure's repeats, and the workload."""

    prefill_tokens_per_s: tuple[float, ...]
    cached_ttft_s: tuple[float, ...]
    decode_tokens_per_s: tuple[float, ...]
    batch_tokens_per_s: tuple[float, ...]
    prompt_tokens: int
    decode_tokens: int
    concurrency: int

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    def as_dict(self) -> dict[str, Any]:
        return {
            **{name: [round(v, 6) for v in getattr(self, name)] for name in FIGURES},
            **{name: getattr(self, name) for name in WORKLOAD},
        }

    @classmethod
    def from_dict(cls, doc: object) -> SpeedFigures:
        """What as_dict() wrote; ValueError names what is wrong."""
        if not isinstance(doc, dict):
            raise ValueError(f"speed figures must be an object, not {type(doc).__name__}")
        names = [f.name for f in fields(cls)]
        if set(doc) != set(names):
            raise ValueError(f"speed figures need exactly {', '.join(names)}")
        for name in WORKLOAD:
            if not (_positive(doc[name]) and isinstance(doc[name], int)):
                raise ValueError(f"speed figures' {name} is {doc[name]!r}, not a positive integer")
        for name in FIGURES:
            samples = doc[name]
            if not (isinstance(samples, list) and samples and all(_positive(v) for v in samples)):
                raise ValueError(f"speed figure {name} is {samples!r}, not a list of positive numbers")
        samples = {name: tuple(float(v) for v in doc[name]) for name in FIGURES}
        return cls(
            samples["prefill_tokens_per_s"],
            samples["cached_ttft_s"],
            samples["decode_tokens_per_s"],
            samples["batch_tokens_per_s"],
            *(int(doc[name]) for name in WORKLOAD),
        )

    def brief(self) -> str:
        return ", ".join(
            f"{label} {value_text(name, self.median(name))} {unit}" for name, (label, unit, _) in FIGURES.items()
        )

    def line(self) -> str:
        return (
            f"{self.brief()}; {self.prompt_tokens}-token prompt, {self.decode_tokens} tokens each, "
            f"{self.concurrency} at once"
        )


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def value_text(name: str, value: float) -> str:
    return f"{value:.3f}" if FIGURES[name][1] == "s" else f"{value:.0f}"


def _times(figures: SpeedFigures, name: str) -> list[float]:
    return [1 / v if FIGURES[name][2] else v for v in getattr(figures, name)]


def speed_ratios(old: SpeedFigures, new: SpeedFigures) -> dict[str, float]:
    """Per figure, the new median speed over the old one."""
    return {name: statistics.median(_times(old, name)) / statistics.median(_times(new, name)) for name in FIGURES}


def best_ratio(old: SpeedFigures, new: SpeedFigures, name: str) -> float:
    # The fastest repeat: load slows some repeats of a good version, a slower build every one.
    return statistics.median(_times(old, name)) / min(_times(new, name))


def comparable(old: SpeedFigures, new: SpeedFigures) -> str | None:
    """Why the two are of different workloads, or None."""
    if (old.decode_tokens, old.concurrency) != (new.decode_tokens, new.concurrency):
        return (
            f"the workload changed: {new.decode_tokens} tokens x {new.concurrency} at once, was "
            f"{old.decode_tokens} x {old.concurrency}"
        )
    if abs(new.prompt_tokens - old.prompt_tokens) > PROMPT_SLACK * old.prompt_tokens:
        return f"the workload changed: a {new.prompt_tokens}-token prompt, was {old.prompt_tokens}"
    return None


def slower(old: SpeedFigures, new: SpeedFigures, tolerance: float) -> list[str]:
    """The figures whose every repeat is slower by more than `tolerance`, worst median first."""
    ratios = speed_ratios(old, new)
    return sorted((name for name in FIGURES if best_ratio(old, new, name) < 1 - tolerance), key=ratios.__getitem__)


def compare(old: SpeedFigures, new: SpeedFigures, tolerance: float) -> str | None:
    """One line naming each slower figure, or None."""
    if comparable(old, new):
        return None
    ratios = speed_ratios(old, new)
    parts = [
        f"{FIGURES[name][0]} {value_text(name, new.median(name))} {FIGURES[name][1]}, was "
        f"{value_text(name, old.median(name))} ({ratios[name]:.2f}x the speed)"
        for name in slower(old, new, tolerance)
    ]
    return "; ".join(parts) + f": every repeat more than {tolerance:.0%} slower" if parts else None


def against(old: SpeedFigures, new: SpeedFigures, tolerance: float) -> str:
    ratios = speed_ratios(old, new)
    noisy = {name for name, r in ratios.items() if r < 1 - tolerance}  # though a repeat was within it
    note = f", a repeat within {tolerance:.0%}"
    return ", ".join(
        f"{label} {value_text(name, new.median(name))} {unit} ({ratios[name]:.2f}x{note if name in noisy else ''})"
        for name, (label, unit, _) in FIGURES.items()
    )


def verdict(earlier: SpeedFigures | None, now: SpeedFigures, tolerance: float) -> tuple[bool, str]:
    """(passed, line); it passes without comparable earlier figures."""
    if earlier is None:
        return True, f"no earlier figures on this host to compare: {now.line()}"
    why = comparable(earlier, now)
    if why:
        return True, f"{why}: {now.line()}, not compared"
    problem = compare(earlier, now, tolerance)
    if problem:
        return False, problem
    return True, f"{against(earlier, now, tolerance)}: within {tolerance:.0%} of the earlier figures"
