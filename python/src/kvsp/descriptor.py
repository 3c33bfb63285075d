"""The Compatibility Descriptor and its ID (section "Compatibility Descriptor
and Compatibility ID", R-CMP-1..17), validated as the Go side validates it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import rfc8785

from . import _json
from .errors import invalid
from .ids import DIGEST_PREFIX, CompatID, parse_digest

COMPAT_LABEL = b"KVSP-COMPAT-1\x00"
MAX_MODEL_NAME_LEN = 1024
MAX_SCALING_NAME_LEN = 32
MAX_BLOCK_TOKENS = 1 << 20
LAYOUT_RAW = "kvsp-layout-1"
ELEMENT_SIZES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8-e4m3": 1, "fp8-e5m2": 1}
_MEMBERS = frozenset(
    {
        "model",
        "model_digest",
        "tokenizer_digest",
        "adapters",
        "layers",
        "kv_heads",
        "head_dim",
        "kv_dtype",
        "positional",
        "block_tokens",
        "layout",
    }
)
_SCALING = re.compile(r"[a-z0-9_-]*")
_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class Positional:
    """A parsed "positional" member (R-CMP-9, A-30)."""

    name: str
    theta: int = 0
    scaling: str = ""

    def __str__(self) -> str:
        if self.name != "rope" or (self.theta == 0 and not self.scaling):
            return self.name
        parts = []
        if self.theta:
            parts.append(f"theta={self.theta}")
        if self.scaling:
            parts.append(f"scaling={self.scaling}")
        return "rope;" + ",".join(parts)


def parse_positional(s: str) -> Positional:
    """``none | rope [";" param *("," param)]``, param ``theta=N`` or ``scaling=name``."""
    name, sep, params = s.partition(";")
    if name == "none":
        if sep:
            raise invalid('positional: "none" takes no parameters')
        return Positional("none")
    if name != "rope":
        raise invalid("positional: not in the KVSP Positional Encodings registry")
    if not sep:
        return Positional("rope")
    if params == "":
        raise invalid("positional: empty parameter list")
    theta, scaling = 0, ""
    for kv in params.split(","):
        k, eq, v = kv.partition("=")
        if not eq or v == "":
            raise invalid("positional: parameter must be name=value")
        if k == "theta":
            if theta:
                raise invalid("positional: theta given twice")
            if v[0] == "0" or not v.isascii() or not v.isdigit():
                raise invalid("positional: theta must be a positive decimal integer without leading zeros")
            t = int(v)
            if t > _json.MAX_JSON_INT:
                raise invalid("positional: theta out of range")
            theta = t
        elif k == "scaling":
            if scaling:
                raise invalid("positional: scaling given twice")
            if len(v) > MAX_SCALING_NAME_LEN or not _SCALING.fullmatch(v):
                raise invalid(
                    f"positional: scaling must be a lowercase name of at most {MAX_SCALING_NAME_LEN} characters"
                )
            scaling = v
        else:
            raise invalid("positional: unknown rope parameter")
    return Positional("rope", theta, scaling)


@dataclass(frozen=True)
class Descriptor:
    model: str
    model_digest: str
    tokenizer_digest: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    positional: str
    block_tokens: int
    layout: str
    adapters: tuple[str, ...] | None = None  # None: absent; never empty (R-CMP-6)

    def validate(self) -> None:
        if self.model == "":
            raise invalid("descriptor: model: required")
        if len(self.model.encode("utf-8")) > MAX_MODEL_NAME_LEN:
            raise invalid(f"descriptor: model: longer than {MAX_MODEL_NAME_LEN} octets")
        for member in ("model_digest", "tokenizer_digest"):
            v = getattr(self, member)
            if v == "" or not any(parse_digest(v)):
                raise invalid(f"descriptor: {member}: required")
        if self.adapters is not None:
            if len(self.adapters) == 0:
                raise invalid("descriptor: adapters: must be absent, not empty, when no adapter is applied")
            for i, a in enumerate(self.adapters):
                if not any(parse_digest(a)):
                    raise invalid(f"descriptor: adapters[{i}]: required")
        bounds = (("layers", _U32), ("kv_heads", _U32), ("head_dim", _U32), ("block_tokens", MAX_BLOCK_TOKENS))
        for member, hi in bounds:
            v = getattr(self, member)
            if not 1 <= v <= hi:
                raise invalid(f"descriptor: {member}: must be an integer in 1..{hi}")
        if self.kv_dtype not in ELEMENT_SIZES:
            raise invalid("descriptor: kv_dtype: not in the KVSP Element Types registry")
        parse_positional(self.positional)
        if self.layout != LAYOUT_RAW:
            raise invalid(f'descriptor: layout: only "{LAYOUT_RAW}" is defined')
        if self.section_size() > _json.MAX_JSON_INT:
            raise invalid("descriptor: geometry: section size overflows")

    def section_size(self) -> int:
        """Octets of one raw K (or V) section of a full block (R-CNT-10)."""
        return self.block_tokens * self.kv_heads * self.head_dim * ELEMENT_SIZES.get(self.kv_dtype, 0)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model": self.model,
            "model_digest": self.model_digest,
            "tokenizer_digest": self.tokenizer_digest,
        }
        if self.adapters is not None:
            d["adapters"] = list(self.adapters)
        d.update(
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            kv_dtype=self.kv_dtype,
            positional=self.positional,
            block_tokens=self.block_tokens,
            layout=self.layout,
        )
        return d

    def jcs(self) -> bytes:
        """RFC 8785 canonical JSON of the canonical descriptor (R-CMP-14)."""
        self.validate()
        d = self.to_json()
        d["positional"] = str(parse_positional(self.positional))
        return rfc8785.dumps(d)

    def compat_id(self) -> CompatID:
        """SHA-256("KVSP-COMPAT-1" || 0x00 || JCS(descriptor)) (R-CMP-13)."""
        return CompatID(hashlib.sha256(COMPAT_LABEL + self.jcs()).digest())


def parse_descriptor(data: bytes) -> Descriptor:
    """Decode and validate a descriptor. An unknown member is refused: it may
    change the stored tensors, and dropping it would give incompatible caches
    one ID."""
    obj = _json.loads(data)
    if not isinstance(obj, dict):
        raise invalid("descriptor: must be a JSON object")
    for k in obj:
        if k not in _MEMBERS:
            raise invalid("descriptor: unknown member")
    where = "descriptor"
    adapters: tuple[str, ...] | None = None
    if "adapters" in obj:
        a = obj["adapters"]
        if not isinstance(a, list):
            raise invalid("descriptor: adapters: must be an array when present")
        for x in a:
            if not isinstance(x, str) or not x.startswith(DIGEST_PREFIX):
                raise invalid('descriptor: adapters: each must be "sha-256:" followed by hex32')
            parse_digest(x)
        adapters = tuple(a)
    for member in ("model_digest", "tokenizer_digest"):
        v = _json.string(obj, member, where)
        if v:
            parse_digest(v)
    d = Descriptor(
        model=_json.string(obj, "model", where),
        model_digest=_json.string(obj, "model_digest", where),
        tokenizer_digest=_json.string(obj, "tokenizer_digest", where),
        layers=_json.integer(obj, "layers", where),
        kv_heads=_json.integer(obj, "kv_heads", where),
        head_dim=_json.integer(obj, "head_dim", where),
        kv_dtype=_json.string(obj, "kv_dtype", where),
        positional=_json.string(obj, "positional", where),
        block_tokens=_json.integer(obj, "block_tokens", where),
        layout=_json.string(obj, "layout", where),
        adapters=adapters,
    )
    d.validate()
    return d
