"""A secret on its way through pyinfra, which logs operation arguments. Only the code writing it to the host calls
reveal()."""

from __future__ import annotations


class Hidden:
    """A secret value that never shows in a repr, a str, or pyinfra's logs."""

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
