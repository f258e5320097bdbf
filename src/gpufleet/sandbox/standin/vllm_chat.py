"""What the stand-in vLLM's "model" sees and says: the ChatML prompt, its tokens, greedy answers, tool arguments."""

from __future__ import annotations

import hashlib
import json
import random
import re
from typing import Any


def chat_prompt(messages: list[dict[str, Any]], tools: list[Any] | None = None, thinking: bool = True) -> str:
    """A ChatML rendering in the shape of Qwen3's template."""
    parts = []
    if tools:
        listed = "\n".join(json.dumps(t) for t in tools)
        system = ""
        if messages and messages[0].get("role") == "system":
            system, messages = f"{_text(messages[0])}\n\n", messages[1:]
        parts.append(
            f"<|im_start|>system\n{system}# Tools\n\nYou may call one or more functions to assist with the user "
            f"query.\n\n<tools>\n{listed}\n</tools><|im_end|>\n"
        )
    for m in messages:
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{_text(m)}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")


def _text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# Pieces of up to 4 letters or digits are about a real BPE's rate on English.
_TOKEN = re.compile(r"<\|[a-z_]+\|>|</?think>|</?tool_call>| ?[A-Za-z0-9]{1,4}|.", re.S)


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


# One token per word.
VOCABULARY = (
    "the a cache river garden answer model token light paper window silver morning quiet table bridge number "
    "engine north summer stone letter orange music simple careful early second people field market harbour "
    "winter yellow forest signal motor valley copper island planet rain blue green seven eleven ninety open "
    "closed ready steady small large warm cold fast slow bright dark left right upper lower inner outer"
).split()
MAX_TOP_LOGPROBS = 20


def greedy_tokens(prompt: str, n: int, top: int, state: bytes = b"") -> list[dict[str, Any]]:
    """The greedy answer to `prompt` as n logprob entries in vLLM's shape; a `state` other than b"" is a wrong one."""
    base = hashlib.sha256(b"standin-greedy\0" + state + b"\0" + prompt.encode()).digest()
    entries = []
    for i in range(n):
        rng = random.Random(hashlib.sha256(base + i.to_bytes(4, "big")).digest())
        picks = rng.sample(range(len(VOCABULARY)), MAX_TOP_LOGPROBS)  # the answer must not vary with top
        logprob = -(0.5 + 0.4 * rng.random())
        ranked = []
        for index in picks:
            word = VOCABULARY[index]
            token = word.capitalize() if i == 0 else f" {word}"
            ranked.append({"token": token, "logprob": round(logprob, 4), "bytes": list(token.encode())})
            logprob -= 1.0 + 0.2 * rng.random()
        entries.append({**ranked[0], "top_logprobs": ranked[:top]})
    return entries


def as_token_ids(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries as vLLM gives them with return_tokens_as_token_ids."""

    def placeholder(token: str) -> str:
        return f"token_id:{2 * VOCABULARY.index(token.strip().lower()) + token.startswith(' ')}"

    return [{**e, "token": placeholder(e["token"]),
             "top_logprobs": [{**t, "token": placeholder(t["token"]), "bytes": list(placeholder(t["token"]).encode())}
                              for t in e["top_logprobs"]]} for e in entries]  # fmt: skip


def stale_tokens(prompt: str, n: int, top: int) -> list[dict[str, Any]]:
    """STANDIN_MISBEHAVE=cache-corrupt: a wrong state's answer, as confident, never the right first token."""
    right = greedy_tokens(prompt, 1, 1)[0]["token"]
    for attempt in range(8):
        wrong = greedy_tokens(prompt, n, top, state=f"stale-{attempt}".encode())
        if not wrong or wrong[0]["token"] != right:
            break
    return wrong


def tool_arguments(tool: dict[str, Any]) -> dict[str, Any]:
    """Each required parameter of the tool's JSON schema, filled in."""
    schema = (tool.get("function") or {}).get("parameters") or {}
    properties = schema.get("properties") or {}
    examples = {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    out: dict[str, Any] = {}
    for name in schema.get("required") or []:
        spec = properties.get(name) or {}
        out[name] = spec["enum"][0] if spec.get("enum") else examples.get(str(spec.get("type")), "example")
    return out
