"""Synthetic conversations of a chosen length in words, for the probe and the serving checks."""

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
    """The same messages for the same (seed, filler, words).

    The seed opens the system prompt, so different seeds share no cache block; the text depends only on `filler`.
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
