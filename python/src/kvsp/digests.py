"""Layer and replica digests and the Repr-Digest field (R-CNT-12, R-CNT-13,
A-4, A-8), as kvsp's Go container package computes them."""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable

from .errors import InvalidError


def layer_digest(k: bytes | memoryview, v: bytes | memoryview) -> bytes:
    """SHA-256(K || V) of one layer's sections."""
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layers: Iterable[bytes]) -> bytes:
    """SHA-256 over the raw 32-octet layer digests in ascending layer order
    (hex text would give another value, A-8)."""
    h = hashlib.sha256()
    for d in layers:
        if len(d) != 32:
            raise InvalidError("invalid: replica digest: a layer digest is 32 octets")
        h.update(d)
    return h.digest()


def repr_digest(d: bytes) -> str:
    """The RFC 9530 Repr-Digest field value: ``sha-256=:<base64>:``."""
    return "sha-256=:" + base64.b64encode(d).decode("ascii") + ":"


def parse_repr_digest(field: str) -> bytes:
    """The sha-256 member of a Repr-Digest (or Content-Digest) field, an RFC
    8941 dictionary; other algorithms are ignored. Base64 must be canonical
    (Go's strict decoding: no stray padding bits, no base64url)."""
    for member in field.split(","):
        member = member.strip(" \t")
        key, eq, val = member.partition("=")
        if not eq or key != "sha-256":
            continue
        val = val.split(";", 1)[0]
        if len(val) < 2 or val[0] != ":" or val[-1] != ":":
            raise InvalidError("container: Repr-Digest sha-256 is not a byte sequence")
        text = val[1:-1]
        try:
            b = base64.b64decode(text, validate=True)
        except binascii.Error:
            b = b""
        if len(b) != 32 or base64.b64encode(b).decode("ascii") != text:
            raise InvalidError("container: Repr-Digest sha-256 is not 32 octets of base64")
        return b
    raise InvalidError("container: Repr-Digest has no sha-256 member")
