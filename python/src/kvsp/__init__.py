"""kvsp: the KV Cache Storage Protocol for Python, byte for byte as kvsp's Go
implementation (compatibility IDs, scope keys, Block Keys, layer and replica
digests, Repr-Digest, the KVB1 header, and containers read as streams and written).

Dependencies: ``rfc8785`` (the JSON Canonicalization Scheme the descriptor's
ID is computed over: small, typed, no dependencies of its own); everything
else is the standard library.
"""

from .blockkeys import Chain, block_keys
from .container import (
    CODEC_FP8_HEAD,
    CODEC_RAW,
    DigestMismatchError,
    Digests,
    Geometry,
    Header,
    Layer,
    MalformedError,
    Reader,
    TruncatedError,
    UnsupportedCodecError,
    Writer,
    new_header,
    parse_header,
)
from .descriptor import Descriptor, Positional, parse_descriptor, parse_positional
from .digests import layer_digest, parse_repr_digest, replica_digest, repr_digest
from .errors import InvalidError, KVSPError, SecretError
from .ids import BlockKey, CompatID, ScopeID, parse_digest
from .scope import ScopeKey

__all__ = [
    "CODEC_FP8_HEAD",
    "CODEC_RAW",
    "BlockKey",
    "Chain",
    "CompatID",
    "Descriptor",
    "DigestMismatchError",
    "Digests",
    "Geometry",
    "Header",
    "InvalidError",
    "KVSPError",
    "Layer",
    "MalformedError",
    "Positional",
    "Reader",
    "ScopeID",
    "ScopeKey",
    "SecretError",
    "TruncatedError",
    "UnsupportedCodecError",
    "Writer",
    "block_keys",
    "layer_digest",
    "new_header",
    "parse_descriptor",
    "parse_digest",
    "parse_header",
    "parse_positional",
    "parse_repr_digest",
    "replica_digest",
    "repr_digest",
]
