"""The JSON requests of every role, without I/O: each builder validates
what it sends as the receiver will (a malformed record raises before a
connection is made) and returns a :class:`Call`, the method, URL and body
with the parser of the answer. The sync client (:mod:`kvsp.client`) and
the asyncio one (:mod:`kvsp.aio`) each only carry Calls, so the two
cannot drift apart."""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

from .baseuri import resource_id
from .errors import InvalidError
from .ids import BlockKey, CompatID, ScopeID
from .records import (
    Checkpoint,
    InstanceStatus,
    LeaseResponse,
    LookupResponse,
    MapUpdate,
    PlaceResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaRecord,
    Reshard,
    ShardMap,
)

T = TypeVar("T")
Parse = Callable[[int, Any, Mapping[str, str]], T]


@dataclass(frozen=True)
class Call(Generic[T]):
    """One JSON request: a status of 300 or more is raised as its problem by
    the carrier; otherwise ``parse(status, decoded body or None, headers)``
    gives the answer (header names in lowercase)."""

    method: str
    url: str
    body: Any
    parse: Parse[T]


def join(base: str, rel: str) -> str:
    return base + rel if base.endswith("/") else base + "/" + rel


def uuid_text(u: bytes) -> str:
    """A UUID's 16 octets in the canonical 8-4-4-4-12 form."""
    h = u.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64


def _none(status: int, out: Any, hdr: Mapping[str, str]) -> None:
    return None


def _state(status: int, out: Any, hdr: Mapping[str, str]) -> str:
    """The state of a state body ({"state": ...})."""
    if not isinstance(out, dict) or not isinstance(out.get("state"), str) or not out["state"]:
        raise InvalidError("invalid: state: required, a registered state")
    return str(out["state"])


def le32(tokens: Sequence[int]) -> str:
    """A prompt as tokens_le32: base64 of little-endian uint32s."""
    try:
        return base64.b64encode(struct.pack(f"<{len(tokens)}I", *tokens)).decode("ascii")
    except struct.error:
        raise InvalidError("invalid: a token must be in 0..2^32-1") from None


def sampler(method: str, p: float | None, seed: int) -> dict[str, Any]:
    s: dict[str, Any] = {"method": method, "seed": seed}
    if p is not None:
        s["params"] = {"p": p}
    return s


def place_body(
    scope: ScopeID,
    compat: CompatID,
    tokens: Sequence[int],
    max_tokens: int,
    method: str,
    p: float | None,
    seed: int,
    session: bytes | None = None,
) -> dict[str, Any]:
    """The body of POST place (the prompt as tokens_le32, as Go's client
    sends it: a quarter of the JSON); with ``session``, that session's."""
    body: dict[str, Any] = {
        "scope_id": scope.hex(),
        "compat_id": compat.hex(),
        "tokens_le32": le32(tokens),
        "max_tokens": max_tokens,
        "sampler": sampler(method, p, seed),
    }
    if session is not None:
        body["session"] = uuid_text(session)
    return body


def generate_body(
    placed: PlaceResponse,
    scope: ScopeID,
    compat: CompatID,
    tokens: Sequence[int],
    max_tokens: int,
    method: str,
    p: float | None,
    seed: int,
    from_: int | None,
) -> dict[str, Any]:
    """The body of POST generate for a placed request."""
    assert placed.session is not None
    body = place_body(scope, compat, tokens, max_tokens, method, p, seed, placed.session)
    body["epoch"] = placed.epoch
    if placed.grant:
        body["grant"] = placed.grant
    if from_ is not None:
        body["from"] = from_
    return body


# The holder.


def lease(base: str, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], ttl_ms: int) -> Call[LeaseResponse]:
    """POST leases (A-2)."""
    body = {"scope_id": scope.hex(), "compat_id": compat.hex(), "block_keys": [k.hex() for k in keys], "ttl_ms": ttl_ms}
    return Call("POST", join(base, "leases"), body, lambda st, out, h: LeaseResponse.decode(out))


def release_lease(base: str, lease_id: str) -> Call[None]:
    """DELETE leases/{lease}."""
    return Call("DELETE", join(base, "leases/" + quote(lease_id, safe="")), None, _none)


# The Index Service.


def publish(base: str, record: dict[str, Any]) -> Call[None]:
    """PUT replicas/{holder-id}/{block_key}."""
    rec = ReplicaRecord.decode(record)
    assert rec.block_key is not None  # required by decode
    return Call("PUT", join(base, f"replicas/{resource_id(rec.holder)}/{rec.block_key.hex()}"), record, _none)


def withdraw(base: str, holder: str, key: BlockKey) -> Call[None]:
    """DELETE replicas/{holder-id}/{block_key}."""
    return Call("DELETE", join(base, f"replicas/{resource_id(holder)}/{key.hex()}"), None, _none)


def lookup(
    base: str, scope: ScopeID, compat: CompatID, keys: Sequence[BlockKey], targets: Sequence[str]
) -> Call[LookupResponse]:
    """POST lookup: the longest prefix of keys with replicas (R-IS-11)."""
    body: dict[str, Any] = {"scope_id": scope.hex(), "compat_id": compat.hex(), "block_keys": [k.hex() for k in keys]}
    if targets:
        body["targets"] = list(targets)
    return Call("POST", join(base, "lookup"), body, lambda st, out, h: LookupResponse.decode(out))


# The Placement Controller.


def place(base: str, body: dict[str, Any]) -> Call[PlaceResponse]:
    """POST place (a body of :func:`place_body`)."""
    return Call("POST", join(base, "place"), body, lambda st, out, h: PlaceResponse.decode(out))


def put_status(base: str, record: dict[str, Any]) -> Call[str]:
    """PUT instances/{instance-id}/status: the state the PC assigns (R-ST-9, A-19)."""
    rec = InstanceStatus.decode(record)
    return Call("PUT", join(base, f"instances/{resource_id(rec.instance)}/status"), record, _state)


def _checkpoint_ack(status: int, out: Any, hdr: Mapping[str, str]) -> int:
    if not isinstance(out, dict) or not is_uint(out.get("output_offset")):
        raise InvalidError("invalid: checkpoint ack: output_offset: required, an unsigned integer")
    return int(out["output_offset"])


def put_checkpoint(base: str, record: dict[str, Any]) -> Call[int]:
    """PUT sessions/{session}/checkpoint: the output offset acknowledged (A-24)."""
    cp = Checkpoint.decode(record)
    assert cp.session is not None  # required by decode
    return Call("PUT", join(base, f"sessions/{uuid_text(cp.session)}/checkpoint"), record, _checkpoint_ack)


def _map_result(status: int, out: Any, hdr: Mapping[str, str]) -> tuple[ShardMap, dict[str, int]]:
    if not isinstance(out, dict):
        raise InvalidError("invalid: map update result: must be an object")
    fetched = out.get("fetched_bytes") or {}
    if not isinstance(fetched, dict) or not all(is_uint(v) for v in fetched.values()):
        raise InvalidError("invalid: map update result: fetched_bytes: an object of unsigned integers")
    return ShardMap.decode(out.get("map") or {}), {str(k): int(v) for k, v in fetched.items()}


def update_map(base: str, update: dict[str, Any]) -> Call[tuple[ShardMap, dict[str, int]]]:
    """PUT maps/{map}: the committed map and the octets each member fetched."""
    u = MapUpdate.decode(update)
    return Call("PUT", join(base, "maps/" + quote(u.map.map, safe="")), update, _map_result)


# The instance.


def _location(status: int, out: Any, hdr: Mapping[str, str]) -> str:
    loc = hdr.get("location")
    if status != 202 or not loc:
        raise InvalidError(f"invalid: prefetch answered {status} without Location")
    return str(loc)


def prefetch(base: str, directive: dict[str, Any]) -> Call[str]:
    """POST prefetch: the Location of the directive's status (R-PF-2)."""
    PrefetchDirective.decode(directive)
    return Call("POST", join(base, "prefetch"), directive, _location)


def prefetch_status(base: str, directive: bytes) -> Call[PrefetchStatus]:
    """GET prefetch/{id} (A-17)."""
    return Call(
        "GET", join(base, "prefetch/" + uuid_text(directive)), None, lambda st, out, h: PrefetchStatus.decode(out)
    )


def set_state(base: str, state: str) -> Call[str]:
    """PUT state (A-19)."""
    return Call("PUT", join(base, "state"), {"state": state}, _state)


def resume(base: str, epoch: int, checkpoint: dict[str, Any]) -> Call[None]:
    """POST sessions/{session}/resume (A-23)."""
    cp = Checkpoint.decode(checkpoint)
    assert cp.session is not None  # required by decode
    if not is_uint(epoch) or epoch == 0:
        raise InvalidError("invalid: resume: epoch: required, at least 1")
    url = join(base, f"sessions/{uuid_text(cp.session)}/resume")
    return Call("POST", url, {"epoch": epoch, "checkpoint": checkpoint}, _none)


def _reshard_ack(status: int, out: Any, hdr: Mapping[str, str]) -> tuple[str, int, int]:
    if (
        not isinstance(out, dict)
        or not isinstance(out.get("map"), str)
        or not is_uint(out.get("version"))
        or not is_uint(out.get("fetched_bytes", 0))
    ):
        raise InvalidError("invalid: reshard ack: map, version and fetched_bytes")
    return out["map"], int(out["version"]), int(out.get("fetched_bytes", 0))


def reshard(base: str, message: dict[str, Any]) -> Call[tuple[str, int, int]]:
    """POST reshard: a plan, commit or abort (A-26)."""
    Reshard.decode(message)
    return Call("POST", join(base, "reshard"), message, _reshard_ack)
