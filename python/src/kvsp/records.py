"""KVSP's JSON records, decoded and validated as kvsp's Go records are:
the same members, the same checks in the same order of severity, and the
same refusals (the shared vectors hold the two to it). Unknown members are
ignored (R-REC-1); a null member is as if absent, as in Go."""

from __future__ import annotations

import base64
import binascii
import itertools
from dataclasses import dataclass
from typing import Any, TypeVar

from . import _json
from .baseuri import normalize_base_uri_named, validate_base_uri
from .errors import TooLargeError, invalid
from .ids import _ID, DIGEST_PREFIX, BlockKey, CompatID, ScopeID, parse_digest, parse_hex

TIERS = ("device", "host", "local-storage", "remote-memory", "remote-storage")
MOQT_NAMESPACE_FIELDS = 5
MAX_LEASE_ID_LEN = 128
_U16, _U32, _U64 = (1 << 16) - 1, (1 << 32) - 1, (1 << 64) - 1

_I = TypeVar("_I", bound=_ID)


def _obj(data: bytes | dict[str, Any], what: str) -> dict[str, Any]:
    obj = _json.loads(data) if isinstance(data, bytes) else data
    if not isinstance(obj, dict):
        raise invalid(f"{what}: must be a JSON object")
    return obj


def _get(obj: dict[str, Any], member: str) -> Any:
    return obj.get(member)


def _uint(obj: dict[str, Any], member: str, what: str, hi: int = _U64) -> int:
    v = _get(obj, member)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or isinstance(v, _json.Float) or not 0 <= v <= hi:
        raise invalid(f"{what}: /{member}: must be an integer in 0..{hi}")
    return v


def _str(obj: dict[str, Any], member: str, what: str) -> str:
    v = _get(obj, member)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise invalid(f"{what}: /{member}: must be a string")
    return v


def _id(obj: dict[str, Any], member: str, cls: type[_I], what: str) -> _I | None:
    """A hex identifier; None when absent or null (Go's zero value)."""
    v = _get(obj, member)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(f"{what}: /{member}: must be a string")
    return cls(parse_hex(v, cls.SIZE, cls.WHAT))


def _list(obj: dict[str, Any], member: str, what: str) -> list[Any] | None:
    v = _get(obj, member)
    if v is None:
        return None
    if not isinstance(v, list):
        raise invalid(f"{what}: /{member}: must be an array")
    return v


def _zero(b: bytes | None) -> bool:
    return b is None or not any(b)


def _check_int(what: str, v: int) -> None:
    if v > _json.MAX_JSON_INT:
        raise invalid(f"{what}: integer outside 0..2^53-1")


@dataclass(frozen=True)
class Residency:
    tier: str
    layers: tuple[int, int]  # inclusive (R-REC-9)
    read_mbit_per_s: int = 0


@dataclass(frozen=True)
class ReplicaRecord:
    """A copy of a block, or of some of its layers, at a holder (R-REC-5..13,
    A-1, A-8, A-14)."""

    block_key: BlockKey | None
    compat_id: CompatID | None
    scope_id: ScopeID | None
    holder: str
    codec: int
    size: int
    digest: bytes | None
    layer_digests: tuple[bytes, ...] | None
    residency: tuple[Residency, ...]
    ttl_ms: int
    moqt_namespace: str = ""

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> ReplicaRecord:
        w = "replica"
        o = _obj(data, w)
        digest = None
        dv = _get(o, "digest")
        if dv is not None:
            if not isinstance(dv, str):
                raise invalid(f"{w}: /digest: must be a string")
            if not dv.startswith(DIGEST_PREFIX):
                raise invalid(f'{w}: /digest: want "{DIGEST_PREFIX}" followed by hex32')
            digest = parse_digest(dv)
        lds = None
        raw = _list(o, "layer_digests", w)
        if raw is not None:
            out = []
            for x in raw:
                if not isinstance(x, str):
                    raise invalid(f"{w}: /layer_digests: each must be a string")
                out.append(parse_hex(x, 32, "layer digest"))
            lds = tuple(out)
        res = []
        for e in _list(o, "residency", w) or []:
            if e is None:
                e = {}
            if not isinstance(e, dict):
                raise invalid(f"{w}: /residency: each must be an object")
            layers = _get(e, "layers")
            if layers is None:
                layers = [0, 0]
            if not isinstance(layers, list) or len(layers) != 2:
                raise invalid(f"{w}: /residency/layers: must be an array of two integers")
            lo = _uint({"v": layers[0]}, "v", f"{w}: residency layers", _U32)
            hi = _uint({"v": layers[1]}, "v", f"{w}: residency layers", _U32)
            res.append(Residency(_str(e, "tier", w), (lo, hi), _uint(e, "read_mbit_per_s", w)))
        r = cls(
            block_key=_id(o, "block_key", BlockKey, w),
            compat_id=_id(o, "compat_id", CompatID, w),
            scope_id=_id(o, "scope_id", ScopeID, w),
            holder=_str(o, "holder", w),
            codec=_uint(o, "codec", w, _U16),
            size=_uint(o, "size", w),
            digest=digest,
            layer_digests=lds,
            residency=tuple(res),
            ttl_ms=_uint(o, "ttl_ms", w),
            moqt_namespace=_str(o, "moqt_namespace", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        w = "replica"
        if _zero(self.block_key):
            raise invalid(f"{w}: block_key: required")
        if _zero(self.compat_id):
            raise invalid(f"{w}: compat_id: required")
        if _zero(self.scope_id):
            raise invalid(f"{w}: scope_id: required")
        if self.codec == 0:
            raise invalid(f"{w}: codec: required, and 0 is reserved")
        if self.size == 0:
            raise invalid(f"{w}: size: required")
        if _zero(self.digest):
            raise invalid(f"{w}: digest: required")
        if self.ttl_ms == 0:
            raise invalid(f"{w}: ttl_ms: required, at least 1")
        if not self.residency:
            raise invalid(f"{w}: residency: required, at least one entry")
        _check_int(f"{w}: size", self.size)
        _check_int(f"{w}: ttl_ms", self.ttl_ms)
        if self.moqt_namespace:
            _validate_moqt_namespace(self.moqt_namespace)
            if normalize_base_uri_named(f"{w}: holder", self.holder) != self.holder:
                raise invalid(f"{w}: holder: base URI is not in normalised form")
            if not self.holder.startswith("moqt://"):
                raise invalid(f"{w}: holder: a record with moqt_namespace names a moqt URI")
        else:
            validate_base_uri(f"{w}: holder", self.holder)
        for i, e in enumerate(self.residency):
            if e.tier not in TIERS:
                raise invalid(f"{w}: residency[{i}].tier: not registered")
            if e.layers[0] > e.layers[1]:
                raise invalid(f"{w}: residency[{i}].layers: first exceeds last")
            _check_int(f"{w}: read_mbit_per_s", e.read_mbit_per_s)
        ranges = sorted(e.layers for e in self.residency)
        for a, b in itertools.pairwise(ranges):
            if b[0] <= a[1]:
                raise invalid(f"{w}: residency: layer ranges overlap")
        if self.layer_digests is not None:
            if not self.layer_digests:
                raise invalid(f"{w}: layer_digests: empty")
            if ranges[-1][1] >= len(self.layer_digests):
                raise invalid(f"{w}: layer_digests: fewer entries than the layers resident")

    def held_layers(self) -> int:
        return sum(e.layers[1] - e.layers[0] + 1 for e in self.residency)


def _validate_moqt_namespace(s: str) -> None:
    """base64url without padding of exactly five length-prefixed fields
    (R-REC-12, A-37)."""
    ok = True
    try:
        b = base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
        ok = "=" not in s and base64.urlsafe_b64encode(b).rstrip(b"=").decode("ascii") == s
    except (binascii.Error, ValueError):
        ok = False
    if not ok:
        raise invalid("replica: moqt_namespace: not base64url without padding")
    for i in range(MOQT_NAMESPACE_FIELDS):
        if not b:
            raise invalid(f"replica: moqt_namespace: fewer than {MOQT_NAMESPACE_FIELDS} fields")
        n = b[0]
        if len(b) < 1 + n:
            raise invalid(f"replica: moqt_namespace: field {i} truncated")
        b = b[1 + n :]
    if b:
        raise invalid("replica: moqt_namespace: octets after the last field")


def _keys(o: dict[str, Any], member: str, what: str) -> list[BlockKey]:
    out = []
    for x in _list(o, member, what) or []:
        if x is None:
            out.append(BlockKey(bytes(32)))
            continue
        if not isinstance(x, str):
            raise invalid(f"{what}: /{member}: each must be a string")
        out.append(BlockKey(parse_hex(x, 32, "block key")))
    return out


@dataclass(frozen=True)
class LeaseRequest:
    """The body of POST leases (A-2)."""

    scope_id: ScopeID | None
    compat_id: CompatID | None
    block_keys: tuple[BlockKey, ...]
    ttl_ms: int

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> LeaseRequest:
        w = "lease"
        o = _obj(data, w)
        r = cls(
            _id(o, "scope_id", ScopeID, w),
            _id(o, "compat_id", CompatID, w),
            tuple(_keys(o, "block_keys", w)),
            _uint(o, "ttl_ms", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        if _zero(self.scope_id):
            raise invalid("lease: scope_id: required")
        if _zero(self.compat_id):
            raise invalid("lease: compat_id: required")
        if not self.block_keys:
            raise invalid("lease: block_keys: required, at least one")
        if self.ttl_ms == 0:
            raise invalid("lease: ttl_ms: required, at least 1")
        for i, k in enumerate(self.block_keys):
            if not any(k):
                raise invalid(f"lease: block_keys[{i}]: zero key")
        _check_int("lease: ttl_ms", self.ttl_ms)


@dataclass(frozen=True)
class LeaseResponse:
    """The body of a granted or renewed lease (A-2)."""

    lease: str
    ttl_ms: int
    block_keys: tuple[BlockKey, ...]

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> LeaseResponse:
        w = "lease response"
        o = _obj(data, w)
        r = cls(_str(o, "lease", w), _uint(o, "ttl_ms", w), tuple(_keys(o, "block_keys", w)))
        r.validate()
        return r

    def validate(self) -> None:
        if self.lease == "" or len(self.lease.encode("utf-8")) > MAX_LEASE_ID_LEN:
            raise invalid(f"lease response: lease: required, at most {MAX_LEASE_ID_LEN} octets")
        if any(not (c.isascii() and (c.isalnum() or c in "-._~")) for c in self.lease):
            raise invalid("lease response: lease: must be path-safe")
        if self.lease in (".", ".."):
            raise invalid("lease response: lease: a dot segment is not path-safe")
        if self.ttl_ms == 0:
            raise invalid("lease response: ttl_ms: required")
        if not self.block_keys:
            raise invalid("lease response: block_keys: required")
        _check_int("lease response: ttl_ms", self.ttl_ms)


def _uuid(o: dict[str, Any], member: str, what: str) -> bytes | None:
    """A UUID in the canonical lowercase 8-4-4-4-12 form; None when absent."""
    v = _get(o, member)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(f"{what}: /{member}: must be a string")
    if len(v) != 36 or v[8] != "-" or v[13] != "-" or v[18] != "-" or v[23] != "-":
        raise invalid(f"{what}: /{member}: uuid: want the lowercase 8-4-4-4-12 form")
    return parse_hex(v[0:8] + v[9:13] + v[14:18] + v[19:23] + v[24:36], 16, "uuid")


MAX_REQUEST_REF_LEN = 4096
LAYER_ORDER_ASCENDING = "ascending"
PREFETCH_STATES = ("pending", "partial", "complete", "failed")


@dataclass(frozen=True)
class PrefetchBlock:
    block_key: BlockKey | None
    sources: tuple[str, ...]


@dataclass(frozen=True)
class PrefetchDirective:
    """The body of POST prefetch (R-PF-1, R-PF-10, R-PF-11)."""

    directive: bytes | None
    scope_id: ScopeID | None
    compat_id: CompatID | None
    blocks: tuple[PrefetchBlock, ...]
    deadline_ms: int
    lease_ms: int
    request_ref: str = ""
    layer_order: str = ""

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> PrefetchDirective:
        w = "prefetch"
        o = _obj(data, w)
        blocks = []
        for b in _list(o, "blocks", w) or []:
            if b is None:
                b = {}
            if not isinstance(b, dict):
                raise invalid(f"{w}: /blocks: each must be an object")
            srcs = []
            for x in _list(b, "sources", w) or []:
                if x is None:
                    x = ""
                if not isinstance(x, str):
                    raise invalid(f"{w}: /blocks/sources: each must be a string")
                srcs.append(x)
            blocks.append(PrefetchBlock(_id(b, "block_key", BlockKey, w), tuple(srcs)))
        r = cls(
            directive=_uuid(o, "directive", w),
            scope_id=_id(o, "scope_id", ScopeID, w),
            compat_id=_id(o, "compat_id", CompatID, w),
            blocks=tuple(blocks),
            deadline_ms=_uint(o, "deadline_ms", w),
            lease_ms=_uint(o, "lease_ms", w),
            request_ref=_str(o, "request_ref", w),
            layer_order=_str(o, "layer_order", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        w = "prefetch"
        if _zero(self.directive):
            raise invalid(f"{w}: directive: required")
        if _zero(self.scope_id):
            raise invalid(f"{w}: scope_id: required")
        if _zero(self.compat_id):
            raise invalid(f"{w}: compat_id: required")
        if not self.blocks:
            raise invalid(f"{w}: blocks: required, at least one")
        if len(self.request_ref.encode("utf-8")) > MAX_REQUEST_REF_LEN:
            raise invalid(f"{w}: request_ref: longer than {MAX_REQUEST_REF_LEN} octets")
        if self.layer_order not in ("", LAYER_ORDER_ASCENDING):
            raise invalid(f'{w}: layer_order: only "{LAYER_ORDER_ASCENDING}" is defined')
        if self.deadline_ms == 0:
            raise invalid(f"{w}: deadline_ms: required, at least 1")
        if self.lease_ms == 0:
            raise invalid(f"{w}: lease_ms: required, at least 1")
        _check_int(f"{w}: deadline_ms", self.deadline_ms)
        _check_int(f"{w}: lease_ms", self.lease_ms)
        for i, b in enumerate(self.blocks):
            if _zero(b.block_key):
                raise invalid(f"{w}: blocks[{i}].block_key: required")
            if not b.sources:
                raise invalid(f"{w}: blocks[{i}].sources: required, at least one")
            for src in b.sources:
                validate_base_uri(f"{w}: blocks[].sources[]", src)


@dataclass(frozen=True)
class PrefetchStatus:
    """The body of GET prefetch/{id} (A-17)."""

    directive: bytes | None
    state: str
    loaded: tuple[BlockKey, ...] | None
    failed: tuple[BlockKey, ...] | None

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> PrefetchStatus:
        w = "prefetch status"
        o = _obj(data, w)
        loaded = tuple(_keys(o, "loaded", w)) if _get(o, "loaded") is not None else None
        failed = tuple(_keys(o, "failed", w)) if _get(o, "failed") is not None else None
        r = cls(_uuid(o, "directive", w), _str(o, "state", w), loaded, failed)
        r.validate()
        return r

    def validate(self) -> None:
        w = "prefetch status"
        if _zero(self.directive):
            raise invalid(f"{w}: directive: required")
        if self.state not in PREFETCH_STATES:
            raise invalid(f"{w}: state: must be pending, partial, complete or failed")
        if self.loaded is None or self.failed is None:
            raise invalid(f"{w}: loaded and failed: required (may be empty)")


def _required(o: dict[str, Any], what: str, *members: str) -> None:
    """Members that must be present and not null (0 is a valid value)."""
    for m in members:
        if o.get(m) is None:
            raise invalid(f"{what}: {m}: required")


def _int(o: dict[str, Any], member: str, what: str) -> int:
    """A Go int (64 bits, signed)."""
    v = _get(o, member)
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or isinstance(v, _json.Float) or not -(1 << 63) <= v < 1 << 63:
        raise invalid(f"{what}: /{member}: must be an integer")
    return v


def _strings(o: dict[str, Any], member: str, what: str) -> tuple[str, ...]:
    out = []
    for x in _list(o, member, what) or []:
        if x is None:
            x = ""
        if not isinstance(x, str):
            raise invalid(f"{what}: /{member}: each must be a string")
        out.append(x)
    return tuple(out)


@dataclass(frozen=True)
class LookupRequest:
    """The body of POST lookup (R-IS-11, R-IS-12)."""

    scope_id: ScopeID | None
    compat_id: CompatID | None
    block_keys: tuple[BlockKey, ...] | None
    targets: tuple[str, ...] = ()

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> LookupRequest:
        w = "lookup"
        o = _json.loads(data) if isinstance(data, bytes) else data
        if o is None:
            o = {}
        if not isinstance(o, dict):
            raise invalid(f"{w}: must be a JSON object")
        keys = tuple(_keys(o, "block_keys", w)) if _get(o, "block_keys") is not None else None
        r = cls(_id(o, "scope_id", ScopeID, w), _id(o, "compat_id", CompatID, w), keys, _strings(o, "targets", w))
        r.validate()
        return r

    def validate(self) -> None:
        if _zero(self.scope_id):
            raise invalid("lookup: scope_id: required")
        if _zero(self.compat_id):
            raise invalid("lookup: compat_id: required")
        if self.block_keys is None:
            raise invalid("lookup: block_keys: required")
        for i, k in enumerate(self.block_keys):
            if not any(k):
                raise invalid(f"lookup: block_keys[{i}]: zero key")
        for t in self.targets:
            validate_base_uri("lookup: targets[]", t)


@dataclass(frozen=True)
class TargetEstimate:
    """The IS's estimate for one lookup target (A-3, A-21, A-22), in µs."""

    instance: str
    fetch_us: int
    recompute_us: int


@dataclass(frozen=True)
class LookupResponse:
    """The answer to POST lookup (A-3): exactly ``matched`` entries of
    replicas, each non-empty."""

    matched: int
    replicas: tuple[tuple[ReplicaRecord, ...], ...]
    targets: tuple[TargetEstimate, ...] = ()

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> LookupResponse:
        w = "lookup response"
        o = _obj(data, w)
        _required(o, w, "matched")
        reps = []
        for entry in _list(o, "replicas", w) or []:
            if entry is None:
                entry = []
            if not isinstance(entry, list):
                raise invalid(f"{w}: /replicas: each must be an array")
            reps.append(tuple(ReplicaRecord.decode(x if x is not None else {}) for x in entry))
        targets = []
        for t in _list(o, "targets", w) or []:
            if t is None:
                t = {}
            if not isinstance(t, dict):
                raise invalid(f"{w}: /targets: each must be an object")
            _required(t, f"{w}: targets[]", "fetch_us", "recompute_us")
            targets.append(TargetEstimate(_str(t, "instance", w), _uint(t, "fetch_us", w), _uint(t, "recompute_us", w)))
        r = cls(_int(o, "matched", w), tuple(reps), tuple(targets))
        r.validate()
        return r

    def validate(self) -> None:
        w = "lookup response"
        if self.matched < 0 or self.matched != len(self.replicas):
            raise invalid(f"{w}: replicas: must have exactly matched entries")
        for i, entry in enumerate(self.replicas):
            if not entry:
                raise invalid(f"{w}: replicas[{i}]: empty")
            for rec in entry:
                rec.validate()
        for t in self.targets:
            validate_base_uri(f"{w}: targets[].instance", t.instance)
            _check_int(f"{w}: fetch_us", t.fetch_us)
            _check_int(f"{w}: recompute_us", t.recompute_us)


INSTANCE_STATES = ("active", "draining", "sleeping", "failed")
MAX_STARTED = 4096


def _float(o: dict[str, Any], member: str, what: str) -> float:
    v = _get(o, member)
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise invalid(f"{what}: /{member}: must be a number")
    try:
        f = float(v)
    except OverflowError:
        raise invalid(f"{what}: /{member}: out of range") from None
    if f != f or f in (float("inf"), float("-inf")):
        raise invalid(f"{what}: /{member}: out of range")
    return f


def _state(o: dict[str, Any], member: str, what: str) -> str | None:
    v = _get(o, member)
    if v is None:
        return None
    if not isinstance(v, str):
        raise invalid(f"{what}: /{member}: must be a string")
    if v not in INSTANCE_STATES:
        raise invalid(f"{what}: /{member}: state: not in the KVSP Instance States registry")
    return v


@dataclass(frozen=True)
class Link:
    holder: str
    mbit_per_s: int
    rtt_us: int


@dataclass(frozen=True)
class InstanceStatus:
    """The Instance Status Record (R-REC-14, R-REC-15, R-ST-*), with kvsp's
    extension members (compat_id, holder, the request limits, started)."""

    instance: str
    epoch: int
    state: str
    running: int
    queued: int
    batch_size: int
    kv_utilization: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    links: tuple[Link, ...] | None
    requested_state: str | None
    ttl_ms: int
    compat_id: CompatID | None = None
    holder: str = ""
    vocab_size: int = 0
    context_tokens: int = 0
    max_output_tokens: int = 0
    started: tuple[bytes, ...] = ()

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> InstanceStatus:
        w = "status"
        o = _obj(data, w)
        _required(
            o, w, "running", "queued", "batch_size", "kv_utilization", "prefill_tokens_per_s", "decode_tokens_per_s"
        )
        links = None
        raw = _list(o, "links", w)
        if raw is not None:
            out = []
            for x in raw:
                if x is None:
                    x = {}
                if not isinstance(x, dict):
                    raise invalid(f"{w}: /links: each must be an object")
                out.append(Link(_str(x, "holder", w), _uint(x, "mbit_per_s", w), _uint(x, "rtt_us", w)))
            links = tuple(out)
        started = []
        for x in _list(o, "started", w) or []:
            if x is None:
                started.append(bytes(16))
                continue
            if not isinstance(x, str):
                raise invalid(f"{w}: /started: each must be a string")
            started.append(parse_hex(x, 16, "grant"))
        r = cls(
            instance=_str(o, "instance", w),
            epoch=_uint(o, "epoch", w),
            state=_state(o, "state", w) or "",
            running=_uint(o, "running", w),
            queued=_uint(o, "queued", w),
            batch_size=_uint(o, "batch_size", w),
            kv_utilization=_float(o, "kv_utilization", w),
            prefill_tokens_per_s=_float(o, "prefill_tokens_per_s", w),
            decode_tokens_per_s=_float(o, "decode_tokens_per_s", w),
            links=links,
            requested_state=_state(o, "requested_state", w),
            ttl_ms=_uint(o, "ttl_ms", w),
            compat_id=_id(o, "compat_id", CompatID, w),
            holder=_str(o, "holder", w),
            vocab_size=_uint(o, "vocab_size", w),
            context_tokens=_uint(o, "context_tokens", w),
            max_output_tokens=_uint(o, "max_output_tokens", w),
            started=tuple(started),
        )
        r.validate()
        return r

    def validate(self) -> None:
        w = "status"
        validate_base_uri(f"{w}: instance", self.instance)
        if self.epoch == 0:
            raise invalid(f"{w}: epoch: required, at least 1")
        if self.state not in INSTANCE_STATES:
            raise invalid(f"{w}: state: required, a registered state")
        if self.ttl_ms == 0:
            raise invalid(f"{w}: ttl_ms: required, at least 1")
        if not 0 <= self.kv_utilization <= 1:
            raise invalid(f"{w}: kv_utilization: must be in [0, 1]")
        if self.prefill_tokens_per_s < 0:
            raise invalid(f"{w}: prefill_tokens_per_s: must be a non-negative number")
        if self.decode_tokens_per_s < 0:
            raise invalid(f"{w}: decode_tokens_per_s: must be a non-negative number")
        if self.links is None:
            raise invalid(f"{w}: links: required (may be empty)")
        if self.holder:
            validate_base_uri(f"{w}: holder", self.holder)
        if self.requested_state is not None and self.requested_state != "sleeping":
            raise invalid(f'{w}: requested_state: must be null or "sleeping"')
        if len(self.started) > MAX_STARTED:
            raise invalid(f"{w}: started: more than {MAX_STARTED}")
        for name in (
            "epoch",
            "running",
            "queued",
            "batch_size",
            "ttl_ms",
            "vocab_size",
            "context_tokens",
            "max_output_tokens",
        ):
            _check_int(f"{w}: {name}", getattr(self, name))
        for i, link in enumerate(self.links):
            validate_base_uri(f"{w}: links[].holder", link.holder)
            if link.mbit_per_s == 0:
                raise invalid(f"{w}: links[{i}].mbit_per_s: required, at least 1")
            _check_int(f"{w}: links[].mbit_per_s", link.mbit_per_s)
            _check_int(f"{w}: links[].rtt_us", link.rtt_us)


def _tokens(o: dict[str, Any], member: str, what: str) -> tuple[int, ...] | None:
    """A token array (integers 0..2^32-1; null: absent; a null element is
    refused, as Go's token decoder refuses it)."""
    v = _get(o, member)
    if v is None:
        return None
    if not isinstance(v, list):
        raise invalid(f"{what}: /{member}: want an array of token ids")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or isinstance(t, _json.Float) or not 0 <= t <= _U32:
            raise invalid(f"{what}: /{member}: token {i}: not an integer 0..2^32-1")
    return tuple(v)


@dataclass(frozen=True)
class Sampler:
    """A session's sampler (R-SES-*): seed, step and deterministic are
    required; params is an object."""

    method: str
    params: dict[str, Any] | None
    seed: int
    step: int
    deterministic: bool

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> Sampler:
        w = "sampler"
        o = _obj(data, w)
        _required(o, w, "seed", "step", "deterministic")
        params = _get(o, "params")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{w}: /params: must be an object")
        det = _get(o, "deterministic")
        if not isinstance(det, bool):
            raise invalid(f"{w}: /deterministic: must be a boolean")
        return cls(_str(o, "method", w), params, _uint(o, "seed", w), _uint(o, "step", w), det)

    def validate(self) -> None:
        if self.method == "":
            raise invalid("sampler: method: required")
        if self.params is None:
            raise invalid("sampler: params: required (an object)")
        _check_int("sampler: seed", self.seed)
        _check_int("sampler: step", self.step)


FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class Checkpoint:
    """A Session Checkpoint (R-SES-5..14): what an instance needs to resume a
    session exactly."""

    session: bytes | None
    epoch: int
    compat_id: CompatID | None
    scope_id: ScopeID | None
    prompt_blocks: tuple[BlockKey, ...] | None
    prompt_tail: tuple[int, ...] | None
    generated: tuple[int, ...] | None
    output_offset: int
    sampler: Sampler
    finish: str = ""  # why the output ended, on a final checkpoint

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> Checkpoint:
        w = "checkpoint"
        o = _obj(data, w)
        _required(o, w, "output_offset", "sampler")
        blocks = tuple(_keys(o, "prompt_blocks", w)) if _get(o, "prompt_blocks") is not None else None
        r = cls(
            session=_uuid(o, "session", w),
            epoch=_uint(o, "epoch", w),
            compat_id=_id(o, "compat_id", CompatID, w),
            scope_id=_id(o, "scope_id", ScopeID, w),
            prompt_blocks=blocks,
            prompt_tail=_tokens(o, "prompt_tail", w),
            generated=_tokens(o, "generated", w),
            output_offset=_uint(o, "output_offset", w),
            sampler=Sampler.decode(_get(o, "sampler")),
            finish=_str(o, "finish", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        w = "checkpoint"
        if _zero(self.session):
            raise invalid(f"{w}: session: required")
        if self.epoch == 0:
            raise invalid(f"{w}: epoch: required, at least 1")
        if _zero(self.compat_id):
            raise invalid(f"{w}: compat_id: required")
        if _zero(self.scope_id):
            raise invalid(f"{w}: scope_id: required")
        if self.prompt_blocks is None:
            raise invalid(f"{w}: prompt_blocks: required (may be empty)")
        if self.prompt_tail is None:
            raise invalid(f"{w}: prompt_tail: required (may be empty)")
        if self.generated is None:
            raise invalid(f"{w}: generated: required (may be empty)")
        if self.output_offset != len(self.generated):
            raise invalid(f"{w}: output_offset: must equal the number of generated tokens")
        if self.finish and self.finish not in FINISH_REASONS:
            raise invalid(f"{w}: finish: one of stop, length, cancelled")
        for i, k in enumerate(self.prompt_blocks):
            if not any(k):
                raise invalid(f"{w}: prompt_blocks[{i}]: zero key")
        _check_int(f"{w}: epoch", self.epoch)
        self.sampler.validate()

    def validate_for(self, block_tokens: int) -> None:
        if self.prompt_tail is not None and len(self.prompt_tail) >= block_tokens:
            raise invalid("checkpoint: prompt_tail: must be shorter than one block")


MAX_PLACE_TOKENS = 1 << 20
MAX_GENERATE_TOKENS = 1 << 20
MAX_GRANT_LEN = (1 + 16 + 16 + 8 + 16 + 32 + 32 + 8 + 8 + 8 + 2 + 2048 + 32 + 2) // 3 * 4
SAMPLERS = ("greedy", "top-p")


@dataclass(frozen=True)
class PlaceSampler:
    """A request's sampler: greedy, or top-p with params.p in (0, 1]."""

    method: str
    params: dict[str, Any] | None
    seed: int

    @classmethod
    def decode(cls, v: Any, what: str) -> PlaceSampler | None:
        if v is None:
            return None
        if not isinstance(v, dict):
            raise invalid(f"{what}: /sampler: must be an object")
        params = _get(v, "params")
        if params is not None and not isinstance(params, dict):
            raise invalid(f"{what}: /sampler/params: must be an object")
        return cls(_str(v, "method", what), params, _uint(v, "seed", what))

    def validate(self, where: str) -> None:
        if self.method == "":
            raise invalid(f"{where}.method: required")
        if self.method not in SAMPLERS:
            raise invalid(f'{where}.method: not one of "greedy", "top-p"')
        for k, p in (self.params or {}).items():
            if self.method != "top-p" or k != "p":
                raise invalid(f"{where}.params: not a parameter of {self.method}")
            if isinstance(p, bool) or not isinstance(p, int | float):
                raise invalid(f"{where}.params.p: a number is required")
            if not 0 < p <= 1:
                raise invalid(f"{where}.params.p: must satisfy 0 < p <= 1")
        if self.method == "top-p" and "p" not in (self.params or {}):
            raise invalid(f"{where}.params.p: required for top-p")
        if self.seed > _json.MAX_JSON_INT:
            raise invalid(f"{where}.seed: 0..2^53-1")


def _prompt(o: dict[str, Any], what: str) -> tuple[int, ...] | None:
    """tokens, or tokens_le32 (base64 of little-endian uint32s): one or the
    other."""
    toks = _tokens(o, "tokens", what)
    le = _get(o, "tokens_le32")
    if le is None:
        return toks
    if not isinstance(le, str):
        raise invalid(f"{what}: /tokens_le32: must be a base64 string")
    try:
        b = base64.b64decode(le, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{what}: /tokens_le32: not base64") from None
    if base64.b64encode(b).decode("ascii") != le:
        raise invalid(f"{what}: /tokens_le32: not base64")
    if toks is not None:
        raise invalid(f"{what}: tokens and tokens_le32: one or the other")
    if len(b) % 4:
        raise invalid(f"{what}: tokens_le32: {len(b)} octets, not a multiple of 4")
    return tuple(int.from_bytes(b[i : i + 4], "little") for i in range(0, len(b), 4))


def _check_place(
    where: str,
    scope: ScopeID | None,
    compat: CompatID | None,
    tokens: tuple[int, ...] | None,
    max_tokens: int,
    session: bytes | None,
    sampler: PlaceSampler | None,
) -> None:
    if _zero(scope):
        raise invalid(f"{where}: scope_id: required")
    if _zero(compat):
        raise invalid(f"{where}: compat_id: required")
    if not tokens:
        raise invalid(f"{where}: tokens: required, at least one")
    if len(tokens) > MAX_PLACE_TOKENS:
        raise TooLargeError(f"{where}: tokens: more than {MAX_PLACE_TOKENS}")
    if max_tokens == 0 or max_tokens > MAX_GENERATE_TOKENS:
        raise invalid(f"{where}: max_tokens: required, 1..{MAX_GENERATE_TOKENS}")
    if session is not None and not any(session):
        raise invalid(f"{where}: session: the nil UUID")
    if sampler is not None:
        sampler.validate(where + ": sampler")


@dataclass(frozen=True)
class PlaceRequest:
    """The body of POST place."""

    scope_id: ScopeID | None
    compat_id: CompatID | None
    tokens: tuple[int, ...] | None
    max_tokens: int
    session: bytes | None = None
    sampler: PlaceSampler | None = None

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> PlaceRequest:
        w = "place"
        o = _obj(data, w)
        r = cls(
            _id(o, "scope_id", ScopeID, w),
            _id(o, "compat_id", CompatID, w),
            _prompt(o, w),
            _uint(o, "max_tokens", w),
            _uuid(o, "session", w),
            PlaceSampler.decode(_get(o, "sampler"), w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        _check_place("place", self.scope_id, self.compat_id, self.tokens, self.max_tokens, self.session, self.sampler)


@dataclass(frozen=True)
class PlaceResponse:
    """The answer to POST place."""

    session: bytes | None
    epoch: int
    instance: str
    matched: int
    directive: bytes | None
    grant: str = ""

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> PlaceResponse:
        w = "place"
        o = _obj(data, w)
        r = cls(
            _uuid(o, "session", w),
            _uint(o, "epoch", w),
            _str(o, "instance", w),
            _int(o, "matched", w),
            _uuid(o, "directive", w),
            _str(o, "grant", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        if _zero(self.session):
            raise invalid("place: session: required")
        if self.epoch == 0:
            raise invalid("place: epoch: required, at least 1")
        if len(self.grant) > MAX_GRANT_LEN:
            raise invalid(f"place: grant: longer than {MAX_GRANT_LEN} characters")
        validate_base_uri("place: instance", self.instance)


@dataclass(frozen=True)
class GenerateRequest:
    """The body of POST generate (an instance's)."""

    session: bytes | None
    epoch: int
    scope_id: ScopeID | None
    compat_id: CompatID | None
    tokens: tuple[int, ...] | None
    max_tokens: int
    sampler: PlaceSampler | None = None
    from_: int | None = None
    grant: str = ""

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> GenerateRequest:
        w = "generate"
        o = _obj(data, w)
        frm = None if _get(o, "from") is None else _uint(o, "from", w)
        r = cls(
            _uuid(o, "session", w),
            _uint(o, "epoch", w),
            _id(o, "scope_id", ScopeID, w),
            _id(o, "compat_id", CompatID, w),
            _prompt(o, w),
            _uint(o, "max_tokens", w),
            PlaceSampler.decode(_get(o, "sampler"), w),
            frm,
            _str(o, "grant", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        if _zero(self.session):
            raise invalid("generate: session: required")
        if self.epoch == 0:
            raise invalid("generate: epoch: required, at least 1")
        if self.max_tokens > MAX_GENERATE_TOKENS:
            raise TooLargeError(f"generate: max_tokens: at most {MAX_GENERATE_TOKENS}")
        if len(self.grant) > MAX_GRANT_LEN:
            raise invalid(f"generate: grant: longer than {MAX_GRANT_LEN} characters")
        _check_place("generate", self.scope_id, self.compat_id, self.tokens, self.max_tokens, None, self.sampler)


@dataclass(frozen=True)
class GeneratedToken:
    """One line of a generate stream; the last has ``done``, and ``finish``
    says why the output ended there (A-39: stop, length, cancelled; its
    index is then the number of output tokens)."""

    index: int
    epoch: int
    token: int
    done: bool = False
    prefill: tuple[int, int] | None = None  # cached, computed
    finish: str = ""

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> GeneratedToken:
        w = "token"
        o = _obj(data, w)
        done = _get(o, "done")
        if done is None:
            done = False
        if not isinstance(done, bool):
            raise invalid(f"{w}: /done: must be a boolean")
        pf = _get(o, "prefill")
        prefill = None
        if pf is not None:
            if not isinstance(pf, dict):
                raise invalid(f"{w}: /prefill: must be an object")
            prefill = (_uint(pf, "cached_tokens", w), _uint(pf, "computed_tokens", w))
        finish = _str(o, "finish", w)
        r = cls(_uint(o, "index", w), _uint(o, "epoch", w), _uint(o, "token", w, _U32), done, prefill, finish)
        if r.epoch == 0:
            raise invalid("token: epoch: required, at least 1")
        if finish and finish not in FINISH_REASONS:
            raise invalid("token: finish: one of stop, length, cancelled")
        if finish and not done:
            raise invalid("token: finish: only on the done line")
        return r


MAX_MAP_ID_LEN = 256


def _range(v: Any, what: str) -> tuple[int, int]:
    """A token range [start, end): two unsigned 64-bit integers (null: zero)."""
    if v is None:
        return (0, 0)
    if not isinstance(v, list) or len(v) != 2:
        raise invalid(f"{what}: a token range is an array of two integers")
    return (_uint({"v": v[0]}, "v", what), _uint({"v": v[1]}, "v", what))


def _ranges(o: dict[str, Any], member: str, what: str) -> tuple[tuple[int, int], ...] | None:
    raw = _list(o, member, what)
    return None if raw is None else tuple(_range(x, what) for x in raw)


def _range_valid(r: tuple[int, int]) -> bool:
    return r[0] < r[1] <= _json.MAX_JSON_INT


def _map_id(rec: str, m: str) -> None:
    if m == "" or len(m.encode("utf-8")) > MAX_MAP_ID_LEN:
        raise invalid(f"{rec}: map: required, at most {MAX_MAP_ID_LEN} octets")


@dataclass(frozen=True)
class Shard:
    tokens: tuple[int, int]
    instance: str


@dataclass(frozen=True)
class ShardMap:
    """A sequence-sharded context's map (A-26): contiguous, non-overlapping
    token ranges from 0, each at an instance."""

    map: str
    version: int
    shards: tuple[Shard, ...]

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> ShardMap:
        r = cls._decode(data)
        r.validate()
        return r

    @classmethod
    def _decode(cls, data: bytes | dict[str, Any]) -> ShardMap:
        w = "shard map"
        o = _obj(data, w)
        _required(o, w, "version")
        shards = []
        for x in _list(o, "shards", w) or []:
            if x is None:
                x = {}
            if not isinstance(x, dict):
                raise invalid(f"{w}: /shards: each must be an object")
            shards.append(Shard(_range(_get(x, "tokens"), w), _str(x, "instance", w)))
        return cls(_str(o, "map", w), _uint(o, "version", w), tuple(shards))

    def validate(self) -> None:
        w = "shard map"
        _map_id(w, self.map)
        _check_int(f"{w}: version", self.version)
        if not self.shards:
            raise invalid(f"{w}: shards: required, at least one")
        nxt = 0
        for i, sh in enumerate(self.shards):
            if not _range_valid(sh.tokens):
                raise invalid(f"{w}: shards[{i}].tokens: must be [start, end) with start < end")
            if sh.tokens[0] != nxt:
                raise invalid(f"{w}: shards[{i}].tokens: not contiguous with the previous shard")
            nxt = sh.tokens[1]
            validate_base_uri(f"{w}: shards[].instance", sh.instance)


@dataclass(frozen=True)
class ReshardFetch:
    tokens: tuple[int, int]
    from_: str
    holder: str = ""
    block_keys: tuple[BlockKey, ...] | None = None


@dataclass(frozen=True)
class Reshard:
    """A reshard message (R-RSH-*): exactly one of a plan (from, to, with
    retain, fetch, release), a commit or an abort."""

    kind: str  # "plan", "commit" or "abort"
    map: str
    from_: int = 0
    to: int = 0
    deadline_ms: int = 0
    retain: tuple[tuple[int, int], ...] = ()
    fetch: tuple[ReshardFetch, ...] = ()
    release: tuple[tuple[int, int], ...] = ()
    commit: int = 0
    abort: int = 0
    scope_id: ScopeID | None = None
    compat_id: CompatID | None = None
    plan: bytes | None = None
    term: int = 0

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> Reshard:
        w = "reshard"
        o = _obj(data, w)
        fetch = []
        for x in _list(o, "fetch", w) or []:
            if x is None:
                x = {}
            if not isinstance(x, dict):
                raise invalid(f"{w}: /fetch: each must be an object")
            keys = tuple(_keys(x, "block_keys", w)) if _get(x, "block_keys") is not None else None
            fetch.append(ReshardFetch(_range(_get(x, "tokens"), w), _str(x, "from", w), _str(x, "holder", w), keys))
        fields = dict(
            map=_str(o, "map", w),
            deadline_ms=_uint(o, "deadline_ms", w),
            retain=_ranges(o, "retain", w) or (),
            fetch=tuple(fetch),
            release=_ranges(o, "release", w) or (),
            scope_id=_id(o, "scope_id", ScopeID, w),
            compat_id=_id(o, "compat_id", CompatID, w),
            plan=_uuid(o, "plan", w),
            term=_uint(o, "term", w),
        )
        nums = {m: _uint(o, m, w) for m in ("from", "to", "commit", "abort")}
        has = {m: _get(o, m) is not None for m in nums}
        kinds = []
        if has["from"] or has["to"]:
            for m in ("from", "to"):
                if not has[m]:
                    raise invalid(f"reshard plan: {m}: required")
            kinds.append("plan")
        if has["commit"]:
            kinds.append("commit")
        if has["abort"]:
            kinds.append("abort")
        if len(kinds) != 1:
            raise invalid("reshard: must be exactly one of a plan (from, to), a commit or an abort")
        r = cls(kind=kinds[0], from_=nums["from"], to=nums["to"], commit=nums["commit"], abort=nums["abort"], **fields)  # type: ignore[arg-type]
        r.validate()
        return r

    def validate(self) -> None:
        _map_id("reshard", self.map)
        for v in (self.from_, self.to, self.commit, self.abort, self.deadline_ms):
            _check_int("reshard: version or deadline", v)
        if self.kind != "plan":
            if self.kind not in ("commit", "abort"):
                raise invalid("reshard: unknown kind")
            return
        if self.deadline_ms == 0:
            raise invalid("reshard plan: deadline_ms: required, at least 1")
        seen: list[tuple[int, int]] = []

        def check(name: str, rs: tuple[tuple[int, int], ...]) -> None:
            for x in rs:
                if not _range_valid(x):
                    raise invalid(f"reshard plan: {name}: ranges must be [start, end) with start < end")
                for y in seen:
                    if x[0] < y[1] and y[0] < x[1]:
                        raise invalid(f"reshard plan: {name}: ranges overlap (a retained range is never transferred)")
                seen.append(x)

        check("retain", self.retain)
        for f in self.fetch:
            validate_base_uri("reshard plan: fetch[].from", f.from_)
            if f.holder:
                validate_base_uri("reshard plan: fetch[].holder", f.holder)
        check("fetch", tuple(f.tokens for f in self.fetch))
        check("release", self.release)

    def validate_for(self, block_tokens: int) -> None:
        """The ranges against the model's block size."""
        if block_tokens < 1:
            raise invalid("reshard plan: block_tokens must be at least 1")
        b = block_tokens
        for x in self.retain:
            if x[0] % b or x[1] % b:
                raise invalid("reshard plan: retain: ranges must be multiples of block_tokens")
        for f in self.fetch:
            if f.tokens[0] % b or f.tokens[1] % b:
                raise invalid("reshard plan: fetch: ranges must be multiples of block_tokens")
            if f.block_keys is not None and len(f.block_keys) != (f.tokens[1] - f.tokens[0]) // b:
                raise invalid("reshard plan: fetch[].block_keys: one key per block of the range")
        for x in self.release:
            if x[0] % b or x[1] % b:
                raise invalid("reshard plan: release: ranges must be multiples of block_tokens")


@dataclass(frozen=True)
class MapUpdate:
    """The body of PUT maps/{map} at the PC."""

    map: ShardMap
    scope_id: ScopeID | None
    compat_id: CompatID | None
    tokens: tuple[int, ...] | None = None
    deadline_ms: int = 0

    @classmethod
    def decode(cls, data: bytes | dict[str, Any]) -> MapUpdate:
        w = "map update"
        o = _obj(data, w)
        m = ShardMap._decode(_get(o, "map") if _get(o, "map") is not None else {"version": 0})
        r = cls(
            m,
            _id(o, "scope_id", ScopeID, w),
            _id(o, "compat_id", CompatID, w),
            _tokens(o, "tokens", w),
            _uint(o, "deadline_ms", w),
        )
        r.validate()
        return r

    def validate(self) -> None:
        if _zero(self.scope_id) or _zero(self.compat_id):
            raise invalid("map update: scope_id and compat_id: required")
        _check_int("map update: deadline_ms", self.deadline_ms)
        self.map.validate()


RECORDS: dict[str, Any] = {
    "shard_map": ShardMap,
    "reshard": Reshard,
    "map_update": MapUpdate,
    "place_request": PlaceRequest,
    "place_response": PlaceResponse,
    "generate_request": GenerateRequest,
    "generated_token": GeneratedToken,
    "checkpoint": Checkpoint,
    "status": InstanceStatus,
    "lookup_request": LookupRequest,
    "lookup_response": LookupResponse,
    "replica": ReplicaRecord,
    "lease_request": LeaseRequest,
    "lease_response": LeaseResponse,
    "prefetch_directive": PrefetchDirective,
    "prefetch_status": PrefetchStatus,
}
