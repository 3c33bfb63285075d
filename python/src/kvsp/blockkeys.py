"""The Block Key chain (section "Scopes and Block Keys", R-KEY-3..8)::

    K[i] = HMAC-SHA-256(scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id ||
                        K[i-1] || uint32be(t[iB]) || ... || uint32be(t[iB+B-1]))

with K[-1] = 32 zero octets. :class:`Chain` extends a session token by
token without recomputing its prefix; :func:`block_keys` keys a whole prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence

from .errors import invalid
from .ids import BlockKey, CompatID
from .scope import ScopeKey

BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
MAX_BLOCK_TOKENS = 1 << 20
_MAX_TOKEN = (1 << 32) - 1


class Chain:
    """Block Keys computed incrementally for one scope, compat_id and block
    size. Not safe for concurrent use; :meth:`clone` forks it."""

    __slots__ = ("_b", "_blocks", "_mac", "_pend", "_prefix", "_prev")

    def __init__(
        self, key: ScopeKey, compat: CompatID, block_tokens: int, prev: BlockKey | None = None, blocks: int = 0
    ) -> None:
        if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
            raise invalid(f"block keys: block_tokens {block_tokens} out of range 1..{MAX_BLOCK_TOKENS}")
        if blocks < 0 or (blocks == 0 and prev is not None and any(prev)) or (blocks > 0 and prev is None):
            raise invalid("block keys: a resumed chain needs its last key and block count")
        self._mac = hmac.new(key._octets(), digestmod=hashlib.sha256)
        self._prefix = BLOCK_LABEL + bytes(compat)
        self._prev = bytes(prev) if prev is not None else bytes(32)
        self._b = block_tokens
        self._pend: list[int] = []
        self._blocks = blocks

    @property
    def block_tokens(self) -> int:
        return self._b

    @property
    def blocks(self) -> int:
        """Complete blocks so far."""
        return self._blocks

    def last(self) -> BlockKey | None:
        """The key of the last complete block, if any."""
        return BlockKey(self._prev) if self._blocks else None

    def pending(self) -> list[int]:
        """Tokens of the block being filled."""
        return list(self._pend)

    def push(self, token: int) -> bool:
        """Add one token; True when it completed a block (see :meth:`last`)."""
        if not 0 <= token <= _MAX_TOKEN:
            raise invalid("block keys: a token must be in 0..2^32-1")
        self._pend.append(token)
        if len(self._pend) < self._b:
            return False
        self._seal()
        return True

    def extend(self, tokens: Iterable[int]) -> list[BlockKey]:
        """Add tokens; return the keys of the blocks they completed."""
        out = []
        for t in tokens:
            if self.push(t):
                out.append(BlockKey(self._prev))
        return out

    def _seal(self) -> None:
        mac = self._mac.copy()
        mac.update(self._prefix)
        mac.update(self._prev)
        mac.update(struct.pack(f">{self._b}I", *self._pend))
        self._prev = mac.digest()
        self._pend.clear()
        self._blocks += 1

    def clone(self) -> Chain:
        c = Chain.__new__(Chain)
        c._mac, c._prefix, c._prev, c._b = self._mac.copy(), self._prefix, self._prev, self._b
        c._pend, c._blocks = list(self._pend), self._blocks
        return c


def block_keys(key: ScopeKey, compat: CompatID, block_tokens: int, tokens: Sequence[int]) -> list[BlockKey]:
    """The keys of every complete block of tokens (the tail has none, R-KEY-8),
    a block at a time: one pack of its tokens and one HMAC each."""
    c = Chain(key, compat, block_tokens)
    b = block_tokens
    pack = struct.Struct(f">{b}I").pack
    base, prefix, prev = c._mac, c._prefix, c._prev
    out = []
    for i in range(0, len(tokens) - len(tokens) % b, b):
        mac = base.copy()
        mac.update(prefix)
        mac.update(prev)
        try:
            mac.update(pack(*tokens[i : i + b]))
        except struct.error:
            raise invalid("block keys: a token must be in 0..2^32-1") from None
        prev = mac.digest()
        out.append(BlockKey(prev))
    return out
