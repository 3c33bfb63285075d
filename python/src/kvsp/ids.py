"""Identifiers: digests, Compatibility IDs, Block Keys, Scope IDs (lowercase
hex on the wire; uppercase is refused, as in Go)."""

from __future__ import annotations

from typing import Self

from .errors import invalid

DIGEST_PREFIX = "sha-256:"
_HEX = frozenset("0123456789abcdef")


def parse_hex(text: str, n: int, what: str) -> bytes:
    """Exactly n octets as 2n lowercase hex digits."""
    if len(text) != 2 * n or not set(text) <= _HEX:
        raise invalid(f"{what}: want {2 * n} lowercase hex digits")
    return bytes.fromhex(text)


class _ID(bytes):
    SIZE = 32
    WHAT = "id"

    def __new__(cls, b: bytes) -> Self:
        if len(b) != cls.SIZE:
            raise invalid(f"{cls.WHAT}: want {cls.SIZE} octets")
        return super().__new__(cls, b)

    @classmethod
    def parse(cls, text: str) -> Self:
        return cls(parse_hex(text, cls.SIZE, cls.WHAT))

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.hex()!r})"


class CompatID(_ID):
    """SHA-256 of the labelled JCS descriptor (R-CMP-13)."""

    WHAT = "compat_id"


class BlockKey(_ID):
    """HMAC-SHA-256 chain value of one block (R-KEY-3)."""

    WHAT = "block key"


class ScopeID(_ID):
    """The first 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || key)."""

    SIZE = 16
    WHAT = "scope_id"


def parse_digest(text: str) -> bytes:
    """ "sha-256:" followed by hex32."""
    if not text.startswith(DIGEST_PREFIX):
        raise invalid(f'digest: want "{DIGEST_PREFIX}" followed by hex32')
    return parse_hex(text[len(DIGEST_PREFIX) :], 32, "digest")
