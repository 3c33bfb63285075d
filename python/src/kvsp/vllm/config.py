"""The connector's configuration: where the kvsp deployment is, who the
engine is to it, and which cache salts share in which scope. No vLLM or
torch here, so that it is read and checked anywhere.

A JSON file named by ``kv_connector_extra_config.config`` (paths in it are
relative to the file), or the same members inline in
``kv_connector_extra_config``::

    {"index": "https://kvsp.example:8443/is/",
     "holder": "https://kvsp.example:8443/h1/",
     "tls": {"cert": "vllm.pem", "key": "vllm.key", "ca": "ca.pem"},
     "block_tokens": 16,
     "scopes": {"salts": [{"salt_sha256": "...", "scope_key_file": "scope-a.key"}],
                "default_scope_key_file": null}}

The identity of ``tls.cert`` needs the producer role (its blocks are PUT)
and the client role (lookup, leases, GET) for every scope ``scopes`` names.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass

from ..baseuri import normalize_base_uri_named
from ..errors import invalid
from ..salts import SaltScopes

LOADS = ("async", "layerwise")
_MEMBERS = frozenset(
    {"index", "holder", "tls", "block_tokens", "scopes", "model", "lease_ttl_ms", "timeout_s", "load", "threads"}
)
_TLS = frozenset({"cert", "key", "ca", "server_identity"})
MAX_CONFIG_OCTETS = 1 << 20


@dataclass(frozen=True)
class ConnectorConfig:
    index: str  # the IS's base URI
    holder: str  # the holder blocks are PUT to (and leased from when the IS names it)
    cert: str
    key: str
    ca: str
    server_identity: str | None
    block_tokens: int  # kvsp's block size: equal to vLLM's or dividing it
    scopes: SaltScopes
    model: str | None = None  # the descriptor's model name; default: the model directory's name
    lease_ttl_ms: int = 30_000
    timeout_s: float = 10.0
    load: str = "async"  # async: between scheduler steps; layerwise: in the step, layer by layer
    threads: int = 4  # concurrent loads and saves


def load_mode(extra: Mapping[str, object]) -> str:
    """``load`` alone (vLLM asks before the connector exists), read
    without the scope keys."""
    try:
        return load_config(extra, scopes=False).load
    except Exception:
        return "async"  # the connector's start refuses the configuration, by name


def load_config(extra: Mapping[str, object], scopes: bool = True) -> ConnectorConfig:
    """The configuration from vLLM's ``kv_connector_extra_config``: a file it
    names as ``config``, or its own members. With scopes False the scope key
    files are not read (a worker needs none)."""
    if "config" in extra:
        if set(extra) != {"config"}:
            raise invalid("kvsp connector: config names a file; give the other members in it, not beside it")
        path = extra["config"]
        if not isinstance(path, str):
            raise invalid("kvsp connector: config: a path")
        p = pathlib.Path(path)
        try:
            raw = p.read_bytes()[: MAX_CONFIG_OCTETS + 1]
        except OSError as e:
            raise invalid(f"kvsp connector: config: {e.strerror}: {path}") from None
        if len(raw) > MAX_CONFIG_OCTETS:
            raise invalid("kvsp connector: config: larger than 1 MiB")
        try:
            conf = json.loads(raw)
        except ValueError as e:
            raise invalid(f"kvsp connector: config: not JSON: {e}") from None
        if not isinstance(conf, dict):
            raise invalid("kvsp connector: config: a JSON object")
        return parse_config(conf, p.resolve().parent, scopes)
    return parse_config(extra, pathlib.Path.cwd(), scopes)


def parse_config(conf: Mapping[str, object], base: pathlib.Path, scopes: bool = True) -> ConnectorConfig:
    """Check every member; an unknown one is refused by name (a misspelt
    key would otherwise fall back to a default silently)."""
    extra = set(conf) - _MEMBERS
    if extra:
        raise invalid(f"kvsp connector: unknown member {sorted(extra)[0]!r}")
    for m in ("index", "holder", "tls", "block_tokens"):
        if m not in conf:
            raise invalid(f"kvsp connector: {m}: required")
    uris = {}
    for m in ("index", "holder"):
        v = conf[m]
        if not isinstance(v, str):
            raise invalid(f"kvsp connector: {m}: a base URI")
        uris[m] = normalize_base_uri_named(f"kvsp connector: {m}", v)
    tls = conf["tls"]
    if not isinstance(tls, dict) or not {"cert", "key", "ca"} <= set(tls) or set(tls) - _TLS:
        raise invalid("kvsp connector: tls: cert, key and ca (server_identity optional)")
    paths = {}
    for m in ("cert", "key", "ca"):
        v = tls[m]
        if not isinstance(v, str) or not v:
            raise invalid(f"kvsp connector: tls.{m}: a path")
        paths[m] = str(base / v)
    ident = tls.get("server_identity")
    if ident is not None and not isinstance(ident, str):
        raise invalid("kvsp connector: tls.server_identity: a URI or null")
    bt = conf["block_tokens"]
    if not isinstance(bt, int) or isinstance(bt, bool) or not 1 <= bt <= 4096:
        raise invalid("kvsp connector: block_tokens: an integer in 1..4096")
    sc = conf.get("scopes", {})
    if not isinstance(sc, dict):
        raise invalid("kvsp connector: scopes: an object (salts, default_scope_key_file)")
    model = conf.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("kvsp connector: model: a name")
    ttl = conf.get("lease_ttl_ms", 30_000)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1_000 <= ttl <= 3_600_000:
        raise invalid("kvsp connector: lease_ttl_ms: 1000..3600000")
    timeout = conf.get("timeout_s", 10.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 600:
        raise invalid("kvsp connector: timeout_s: in (0, 600]")
    load = conf.get("load", "async")
    if load not in LOADS:
        raise invalid(f"kvsp connector: load: one of {', '.join(LOADS)}")
    threads = conf.get("threads", 4)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
        raise invalid("kvsp connector: threads: 1..64")
    return ConnectorConfig(
        index=uris["index"],
        holder=uris["holder"],
        cert=paths["cert"],
        key=paths["key"],
        ca=paths["ca"],
        server_identity=ident,
        block_tokens=bt,
        scopes=SaltScopes.from_config(sc, base) if scopes else SaltScopes(),
        model=model,
        lease_ttl_ms=ttl,
        timeout_s=float(timeout),
        load=str(load),
        threads=threads,
    )
