"""A secret passed through pyinfra, which logs operation arguments; only the write to the host calls reveal()."""

from __future__ import annotations


class Hidden:
    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Hidden(***)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Hidden) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)
