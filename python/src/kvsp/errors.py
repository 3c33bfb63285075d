"""Errors, one class per KVSP problem type and generic status (RFC 9457),
as kvsp's Go ``ProblemTypes`` table maps them, and problem details decoded
into them (:func:`parse_problem`, :func:`problem_error`).

Every error the package raises for bad input is a :class:`KVSPError`; its
message names the member or check, never the value (values may be tokens or
secrets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PROBLEM_TYPE_BASE = "https://iana.org/assignments/kvsp#"


class KVSPError(Exception):
    """Base of every KVSP error: ``problem_type`` is its type URI (for the
    KVSP types), ``status`` its HTTP status, ``kind`` the Go sentinel's text;
    ``problem`` is the problem details it was decoded from, if any."""

    problem_type = "about:blank"
    status = 500
    kind = "kvsp: internal error"
    problem: Problem | None = None


class NotFoundError(KVSPError):
    """kvsp-not-found (404): block, lease, session or directive unknown."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-not-found", 404, "kvsp: not found"


class ScopeDeniedError(KVSPError):
    """kvsp-scope-denied (403): the client is not authorized for the scope."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-scope-denied", 403, "kvsp: scope denied"


class IncompatibleError(KVSPError):
    """kvsp-incompatible (409): Compatibility ID mismatch."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-incompatible", 409, "kvsp: incompatible"


class LeaseQuotaError(KVSPError):
    """kvsp-lease-quota (429)."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-lease-quota", 429, "kvsp: lease quota exceeded"


class StaleEpochError(KVSPError):
    """kvsp-stale-epoch (409): an epoch older than the current one."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-stale-epoch", 409, "kvsp: stale epoch"


class InvalidStateError(KVSPError):
    """kvsp-invalid-state (409): not allowed in the instance's state."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-invalid-state", 409, "kvsp: invalid state"


class DigestMismatchError(KVSPError):
    """kvsp-digest-mismatch (422): data that does not match its digest."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-digest-mismatch", 422, "kvsp: digest mismatch"


class PlanConflictError(KVSPError):
    """kvsp-plan-conflict (409): a reshard plan against another map version."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-plan-conflict", 409, "kvsp: plan conflict"


class LayersUnavailableError(KVSPError):
    """kvsp-layers-unavailable (404): the requested layers are not held."""

    problem_type, status, kind = PROBLEM_TYPE_BASE + "kvsp-layers-unavailable", 404, "kvsp: layers unavailable"


class InvalidError(KVSPError, ValueError):
    """400: an input that breaks a KVSP rule."""

    status, kind = 400, "kvsp: invalid request"


class ForbiddenError(KVSPError):
    status, kind = 403, "kvsp: forbidden"


class MethodNotAllowedError(KVSPError):
    status, kind = 405, "kvsp: method not allowed"


class ConflictError(KVSPError):
    status, kind = 409, "kvsp: conflict"


class RequestTimeoutError(KVSPError):
    status, kind = 408, "kvsp: request timeout"


class PreconditionFailedError(KVSPError):
    status, kind = 412, "kvsp: precondition failed"


class TooLargeError(KVSPError):
    status, kind = 413, "kvsp: content too large"


class UnsupportedMediaTypeError(KVSPError):
    status, kind = 415, "kvsp: unsupported media type"


class PreconditionRequiredError(KVSPError):
    status, kind = 428, "kvsp: precondition required"


class TooManyRequestsError(KVSPError):
    status, kind = 429, "kvsp: too many requests"


class InternalError(KVSPError):
    status, kind = 500, "kvsp: internal error"


class UnavailableError(KVSPError):
    status, kind = 503, "kvsp: service unavailable"


class SecretError(KVSPError):
    """A scope key was about to be encoded (it never goes on the wire)."""

    kind = "kvsp: refusing to encode a secret"


# The table, in Go's order: KVSP types by suffix, then generic statuses.
_TYPED: tuple[type[KVSPError], ...] = (
    NotFoundError,
    ScopeDeniedError,
    IncompatibleError,
    LeaseQuotaError,
    StaleEpochError,
    InvalidStateError,
    DigestMismatchError,
    PlanConflictError,
    LayersUnavailableError,
)
_GENERIC: tuple[type[KVSPError], ...] = (
    InvalidError,
    ForbiddenError,
    MethodNotAllowedError,
    ConflictError,
    RequestTimeoutError,
    PreconditionFailedError,
    TooLargeError,
    UnsupportedMediaTypeError,
    PreconditionRequiredError,
    TooManyRequestsError,
    InternalError,
    UnavailableError,
)


ErrorClass = type[KVSPError]


@dataclass
class Problem:
    """An RFC 9457 problem details object."""

    type: str
    status: int
    title: str = ""
    detail: str = ""
    instance: str = ""
    extensions: dict[str, Any] = field(default_factory=dict)

    def error_class(self) -> ErrorClass:
        """The class this problem stands for: a KVSP type by its URI; an
        unknown type or about:blank by its status, and a status not in the
        table by its class (R-HTTP-9)."""
        for c in _TYPED:
            if self.type == c.problem_type:
                return c
        for c in _GENERIC:
            if c.status == self.status:
                return c
        if self.status == 404:
            return NotFoundError  # a miss, whatever the type (R-IS-10, A-28)
        if 400 <= self.status < 500:
            return InvalidError
        return UnavailableError

    def __str__(self) -> str:
        s = "kvsp: problem "
        if self.type not in ("about:blank", ""):
            s += self.type.removeprefix(PROBLEM_TYPE_BASE) + " "
        s += f"(status {self.status})"
        return s + (": " + self.detail if self.detail else "")


def problem_error(p: Problem) -> KVSPError:
    """The exception for a decoded problem (its ``problem`` set)."""
    e = p.error_class()(str(p))
    e.problem = p
    return e


def parse_problem(body: bytes, http_status: int) -> Problem:
    """Decode an application/problem+json body strictly, as Go's
    ParseProblem: a body that is not a problem object, or whose status
    disagrees with the HTTP status, is an error."""
    from . import _json  # _json imports this module

    obj = _json.loads(body)
    if not isinstance(obj, dict):
        raise invalid("problem details: not an object")
    members = {}
    for m in ("type", "title", "detail", "instance"):
        v = obj.get(m, "")
        if v is None:
            v = ""
        if not isinstance(v, str):
            raise invalid(f"problem details: {m}: must be a string")
        members[m] = v
    status = obj.get("status", 0)
    if status is None:
        status = 0
    if isinstance(status, bool) or not isinstance(status, int) or isinstance(status, _json.Float):
        raise invalid("problem details: status: must be an integer")
    if not -(1 << 63) <= status < 1 << 63:
        raise invalid("problem details: status: out of range")
    if members["type"] == "":
        members["type"] = "about:blank"  # RFC 9457 section 3.1.1
    if status == 0:
        status = http_status
    if http_status != 0 and status != http_status:
        raise invalid(f"problem details: problem status {status} differs from HTTP status {http_status}")
    ext = {k: v for k, v in obj.items() if k not in ("type", "title", "status", "detail", "instance")}
    return Problem(members["type"], status, members["title"], members["detail"], members["instance"], ext)


def invalid(msg: str) -> InvalidError:
    return InvalidError("invalid: " + msg)
