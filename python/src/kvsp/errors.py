"""Errors, named after the KVSP problem types (RFC 9457 problem details).

Every error the package raises for bad input is a :class:`KVSPError`; its
message names the member or check, never the value (values may be tokens or
secrets).
"""

from __future__ import annotations

PROBLEM_TYPE_BASE = "https://iana.org/assignments/kvsp#"


class KVSPError(Exception):
    """Base of every KVSP error: ``problem_type`` is its type URI, ``status``
    its HTTP status."""

    problem_type = "about:blank"
    status = 500


class InvalidError(KVSPError, ValueError):
    """400: an input that breaks a KVSP rule (the Go side's ErrInvalid)."""

    status = 400


class SecretError(KVSPError):
    """A scope key was about to be encoded (it never goes on the wire)."""


class NotFoundError(KVSPError):
    problem_type = PROBLEM_TYPE_BASE + "kvsp-not-found"
    status = 404


class ScopeDeniedError(KVSPError):
    problem_type = PROBLEM_TYPE_BASE + "kvsp-scope-denied"
    status = 403


class IncompatibleError(KVSPError):
    problem_type = PROBLEM_TYPE_BASE + "kvsp-incompatible"
    status = 409


def invalid(msg: str) -> InvalidError:
    return InvalidError("invalid: " + msg)
