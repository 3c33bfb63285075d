"""Cache salts to scopes, for engines that take a salt from the request.

vLLM lets a request carry a ``cache_salt``: requests with different salts
never share prefix-cached KV. The salt comes from the caller, so it is
whatever the caller claims. A connector that took a salt's value as the
name of a kvsp scope, or derived a scope from any salt, would let a caller
who guesses or learns another tenant's salt read that tenant's KV.
:class:`SaltScopes` maps only configured secret salts, each held as its
SHA-256 (never as text), to scope keys; a request with no salt, or with one
that is not configured, shares within the configured default scope, or not
at all (the default).

The configuration (a connector's extra configuration, for example)::

    {"salts": [{"salt_sha256": "<64 hex digits>", "scope_key_file": "scope-a.key"}],
     "default_scope_key_file": null}

``printf %s "$SALT" | sha256sum`` gives a salt's digest.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import invalid
from .ids import parse_hex
from .scope import ScopeKey

MAX_SALTS = 65536
MAX_SALT_OCTETS = 1024  # a longer salt is no configured one: nothing is shared
_ENTRY = frozenset({"salt_sha256", "scope_key_file"})
_CONF = frozenset({"salts", "default_scope_key_file"})


@dataclass(frozen=True, repr=False)
class SaltScopes:
    """Configured secret salts and the scope each shares in; ``default``
    is the scope of requests with no salt or an unknown one (None: they
    share nothing)."""

    _by_digest: Mapping[bytes, ScopeKey] = field(default_factory=dict)
    default: ScopeKey | None = None

    def scope_for(self, salt: str | None) -> ScopeKey | None:
        """The scope a request with this salt shares in, or None: its KV is
        neither looked up nor stored."""
        if not salt:
            return self.default
        octets = salt.encode("utf-8", "surrogatepass")
        if len(octets) > MAX_SALT_OCTETS:
            return self.default
        return self._by_digest.get(hashlib.sha256(octets).digest(), self.default)

    def __repr__(self) -> str:
        d = "a default scope" if self.default is not None else "no default scope"
        return f"SaltScopes({len(self._by_digest)} salts, {d})"

    @classmethod
    def from_config(cls, conf: Mapping[str, object], base: pathlib.Path) -> SaltScopes:
        """Read a configuration as the module describes (key files relative
        to base); anything else in it is refused, by name."""
        extra = set(conf) - _CONF
        if extra:
            raise invalid(f"salts: unknown member {sorted(extra)[0]!r}")
        salts = conf.get("salts", [])
        if not isinstance(salts, list) or len(salts) > MAX_SALTS:
            raise invalid(f"salts: want a list of at most {MAX_SALTS} entries")
        by: dict[bytes, ScopeKey] = {}
        for i, e in enumerate(salts):
            if not isinstance(e, dict) or set(e) != _ENTRY:
                raise invalid(f"salts[{i}]: want exactly salt_sha256 and scope_key_file")
            digest, path = e["salt_sha256"], e["scope_key_file"]
            if not isinstance(digest, str) or not isinstance(path, str):
                raise invalid(f"salts[{i}]: salt_sha256 and scope_key_file are strings")
            d = parse_hex(digest, 32, f"salts[{i}].salt_sha256")
            if d in by:
                raise invalid(f"salts[{i}]: the salt of an earlier entry")
            by[d] = _key(base, path, f"salts[{i}].scope_key_file")
        default = conf.get("default_scope_key_file")
        if default is not None and not isinstance(default, str):
            raise invalid("salts: default_scope_key_file is a path or null")
        return cls(by, _key(base, default, "default_scope_key_file") if default else None)


def _key(base: pathlib.Path, path: str, what: str) -> ScopeKey:
    try:
        text = (base / path).read_text()
    except OSError as e:
        raise invalid(f"{what}: {e.strerror}: {path}") from None
    return ScopeKey.from_hex(text)
