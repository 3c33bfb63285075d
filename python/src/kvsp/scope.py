"""Scope keys and Scope IDs (section "Scopes and Block Keys").

A :class:`ScopeKey` never shows its octets: ``repr``, ``str``, ``format``,
pickling and JSON encoding all refuse or print REDACTED, so a key cannot
reach a log line or an exception by accident.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import NoReturn

from .errors import SecretError, invalid
from .ids import ScopeID, parse_hex

MIN_SCOPE_KEY_LEN = 32
_REDACTED = "REDACTED"


class ScopeKey:
    """A scope's secret key: at least 32 octets."""

    __slots__ = ("__k",)

    def __init__(self, octets: bytes) -> None:
        if len(octets) < MIN_SCOPE_KEY_LEN:
            raise invalid(f"scope key: at least {MIN_SCOPE_KEY_LEN} octets")
        self.__k = bytes(octets)

    @classmethod
    def from_hex(cls, text: str) -> ScopeKey:
        """Parse a key file's text: lowercase hex, an optional final newline."""
        if text.endswith("\n"):
            text = text[:-1]
        if len(text) % 2 or len(text) < 2 * MIN_SCOPE_KEY_LEN:
            raise invalid(f"scope key: want at least {2 * MIN_SCOPE_KEY_LEN} lowercase hex digits")
        return cls(parse_hex(text, len(text) // 2, "scope key"))

    def scope_id(self) -> ScopeID:
        return ScopeID(hashlib.sha256(b"KVSP-SCOPE-1\x00" + self.__k).digest()[:16])

    def _octets(self) -> bytes:
        return self.__k

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScopeKey) and hmac.compare_digest(self.__k, other.__k)

    def __hash__(self) -> int:
        return hash(self.scope_id())

    def __repr__(self) -> str:
        return f"ScopeKey({_REDACTED})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __reduce__(self) -> NoReturn:
        raise SecretError("scope keys are never serialized")
