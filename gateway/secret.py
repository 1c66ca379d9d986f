"""`Secret`: the one type for connection strings, keys and tokens the gateway holds."""

from __future__ import annotations

import hmac


class Secret:
    """A string that never shows itself in reprs, logs, tracebacks or error messages, and
    compares in constant time (a key compared with ``==`` leaks its prefix through timing)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        """The secret value; call only where it is used (signing, connecting), never to
        display it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash((Secret, self._value))
