"""kvsp: the KV Cache Storage Protocol for Python, byte for byte as kvsp's Go
implementation (compatibility IDs, scope keys, Block Keys, layer and replica
digests, Repr-Digest).

Dependencies: ``rfc8785`` (the JSON Canonicalization Scheme the descriptor's
ID is computed over: small, typed, no dependencies of its own); everything
else is the standard library.
"""

from .blockkeys import Chain, block_keys
from .descriptor import Descriptor, Positional, parse_descriptor, parse_positional
from .digests import layer_digest, parse_repr_digest, replica_digest, repr_digest
from .errors import InvalidError, KVSPError, SecretError
from .ids import BlockKey, CompatID, ScopeID, parse_digest
from .scope import ScopeKey

__all__ = [
    "BlockKey",
    "Chain",
    "CompatID",
    "Descriptor",
    "InvalidError",
    "KVSPError",
    "Positional",
    "ScopeID",
    "ScopeKey",
    "SecretError",
    "block_keys",
    "layer_digest",
    "parse_descriptor",
    "parse_digest",
    "parse_positional",
    "parse_repr_digest",
    "replica_digest",
    "repr_digest",
]
