"""KVSP's strict JSON (decisions A-29, A-33), as the Go side decodes it.

Python's ``json`` is looser than KVSP allows; these checks make the two
sides refuse the same inputs: octets that are not UTF-8, a byte-order mark,
duplicate member names, ``NaN`` and ``Infinity``, lone surrogates, trailing
data, and (for members that are integers) ``true``, ``1.0`` and integers
outside 0..2^53-1.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import invalid

MAX_JSON_INT = (1 << 53) - 1


class Float(float):
    """A JSON number written with a fraction or exponent: never an integer."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise invalid("duplicate member name")
        out[k] = v
    return out


def _constant(name: str) -> Any:
    raise invalid("not a JSON number: " + name)


def _check_strings(v: Any) -> None:
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise invalid("a string holds a lone surrogate") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_strings(k)
            _check_strings(x)
    elif isinstance(v, list):
        for x in v:
            _check_strings(x)


def loads(data: bytes) -> Any:
    """Decode one JSON value strictly."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("not UTF-8") from None
    if text.startswith("\ufeff"):
        raise invalid("a byte-order mark before the value")
    try:
        v = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, parse_float=Float)
    except json.JSONDecodeError as e:
        raise invalid(f"malformed JSON at offset {e.pos}") from None
    _check_strings(v)
    return v


def integer(obj: dict[str, Any], member: str, where: str, lo: int = 0, hi: int = MAX_JSON_INT) -> int:
    """obj[member] as an integer in lo..hi (absent: 0, as Go's zero value)."""
    v = obj.get(member, 0)
    if isinstance(v, bool) or not isinstance(v, int) or isinstance(v, Float):
        raise invalid(f"{where}: {member}: must be an integer")
    if v < 0 or v > MAX_JSON_INT:
        raise invalid(f"{where}: {member}: out of range")
    if v < lo or v > hi:
        raise invalid(f"{where}: {member}: must be an integer in {lo}..{hi}")
    return v


def string(obj: dict[str, Any], member: str, where: str) -> str:
    """obj[member] as a string (absent: "")."""
    v = obj.get(member, "")
    if not isinstance(v, str):
        raise invalid(f"{where}: {member}: must be a string")
    return v
