"""Synthetic conversations of a crafted length for the probe and the serving checks: filler words stand in for a
tokenizer (the caller measures tokens per word on the server)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

FILLER_WORDS = (
    "the server keeps a cache of every block it has seen so a long conversation should not be processed again "
    "when the next question arrives and the operator wants to know that this really happens on each host"
).split()


def filler_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(FILLER_WORDS) for _ in range(words))


@dataclass
class Conversation:
    """A deterministic synthetic conversation: (seed, filler, words) -> the same messages every time.

    The seed opens the system prompt, so conversations with different seeds differ inside their first cache
    block and share nothing cacheable; the filler (the history's text) depends only on `filler`, so a twin with
    another seed has the same length to within the seed's own tokens.
    """

    seed: str
    filler: str
    words: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.filler)
        turns, left = [], self.words
        for i in range(3):
            n = left // (3 - i)
            left -= n
            turns.append(filler_text(rng, n))
        self.messages = [
            {"role": "system", "content": f"Conversation {self.seed}. You are a terse assistant."},
            {"role": "user", "content": turns[0]},
            {"role": "assistant", "content": turns[1]},
            {"role": "user", "content": turns[2] + " What follows?"},
        ]

    def next_turn(self, reply: str, question: str = "And then?") -> list[dict[str, str]]:
        return [*self.messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
