"""The KVB1 container's header (R-CNT-1..6, A-9), encoded and checked as
kvsp's Go container package does: every length is checked against the
model's geometry before anything is allocated."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from .descriptor import ELEMENT_SIZES, Descriptor
from .errors import InvalidError

MAGIC = 0x4B564231  # "KVB1"
VERSION = 1
FIXED_HEADER_LEN = 20
LAYER_ENTRY_LEN = 16
CODEC_RAW = 0x0001
CODEC_FP8_HEAD = 0xFF01  # this project's private-use codec (R-REG-5)
_MAX_UNKNOWN_DATA = 1 << 62
_FIXED = struct.Struct(">IBBHIII")
_ENTRY = struct.Struct(">QQ")


class MalformedError(InvalidError):
    """The octets are not a valid container for the geometry (a holder
    answers 400)."""


class TruncatedError(MalformedError):
    """The octets end inside the header or a layer."""


class UnsupportedCodecError(InvalidError):
    """No codec is registered for the header's value."""


@dataclass(frozen=True)
class Geometry:
    """What a receiver knows of the model before it reads a container."""

    layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    elem: str  # kv_dtype

    @classmethod
    def of(cls, d: Descriptor) -> Geometry:
        return cls(d.layers, d.block_tokens, d.kv_heads, d.head_dim, d.kv_dtype)

    def elements(self) -> int:
        return self.block_tokens * self.kv_heads * self.head_dim

    def raw_section_len(self) -> int:
        return self.elements() * ELEMENT_SIZES.get(self.elem, 0)

    def validate(self) -> None:
        if 0 in (self.layers, self.block_tokens, self.kv_heads, self.head_dim):
            raise MalformedError("container: malformed: geometry has a zero dimension")
        if self.elem not in ELEMENT_SIZES:
            raise MalformedError("container: malformed: unknown element type")
        if self.raw_section_len() > 1 << 40:
            raise MalformedError("container: malformed: section over 1 TiB")


def section_len(codec: int, g: Geometry) -> int:
    """Octets of one K (or V) section of a full block under codec."""
    if codec == CODEC_RAW:
        return g.raw_section_len()
    if codec == CODEC_FP8_HEAD:
        return 4 * g.kv_heads + g.elements()
    raise UnsupportedCodecError(f"container: unsupported codec: 0x{codec:04x}")


@dataclass(frozen=True)
class Header:
    codec: int
    first_layer: int
    token_count: int
    layers: tuple[tuple[int, int], ...] = field(default=())  # (K, V) octets per layer, ascending

    @property
    def layer_count(self) -> int:
        return len(self.layers)

    def __len__(self) -> int:
        return header_len(len(self.layers))

    def data_len(self) -> int:
        return sum(k + v for k, v in self.layers)

    def size(self) -> int:
        return len(self) + self.data_len()

    def to_bytes(self) -> bytes:
        """Version 1, Flags 0."""
        out = bytearray(
            _FIXED.pack(MAGIC, VERSION, 0, self.codec, self.first_layer, len(self.layers), self.token_count)
        )
        for k, v in self.layers:
            out += _ENTRY.pack(k, v)
        return bytes(out)


def header_len(n: int) -> int:
    return FIXED_HEADER_LEN + LAYER_ENTRY_LEN * n


def new_header(codec: int, first: int, count: int, g: Geometry) -> Header:
    """The header of a container of layers [first, first+count)."""
    n = section_len(codec, g)
    g.validate()
    if count == 0 or first + count > g.layers:
        raise MalformedError(f"container: malformed: layers {first}+{count} outside 0..{g.layers - 1}")
    return Header(codec, first, g.block_tokens, ((n, n),) * count)


def parse_header(b: bytes | bytearray | memoryview, g: Geometry | None) -> tuple[Header, int]:
    """Parse and check the header at the start of b against g (A-9); with
    g None (a receiver without the descriptor) only what needs none is
    checked. Returns the header and its length. Nothing is allocated
    before the Layer Count is checked."""
    if g is not None:
        g.validate()
    if len(b) < FIXED_HEADER_LEN:
        raise TruncatedError("container: malformed: truncated in header")
    magic, version, flags, codec, first, count, tokens = _FIXED.unpack_from(b)
    if magic != MAGIC:
        raise MalformedError("container: malformed: magic is not KVB1")
    if version != VERSION:
        raise MalformedError(f"container: malformed: version {version}, only 1 is defined")
    if flags != 0:
        raise MalformedError("container: malformed: reserved flags set")
    if codec == 0:
        raise MalformedError("container: malformed: codec 0 is reserved")
    if count == 0:
        raise MalformedError("container: malformed: layer count 0")
    if g is None:
        if first + count > 1 << 32:
            raise MalformedError("container: malformed: layers past 2^32")
    else:
        if first + count > g.layers:
            raise MalformedError(
                f"container: malformed: layers {first}..{first + count - 1} beyond the model's {g.layers}"
            )
        if tokens != g.block_tokens:
            raise MalformedError(f"container: malformed: token count {tokens}, block_tokens is {g.block_tokens}")
        want = section_len(codec, g)
    hl = header_len(count)
    if len(b) < hl:
        raise TruncatedError("container: malformed: truncated in header")
    layers = []
    total = 0
    for i in range(count):
        k, v = _ENTRY.unpack_from(b, FIXED_HEADER_LEN + LAYER_ENTRY_LEN * i)
        if g is None:
            total += k + v
            if k > _MAX_UNKNOWN_DATA or v > _MAX_UNKNOWN_DATA or total > _MAX_UNKNOWN_DATA:
                raise MalformedError("container: malformed: section lengths past 2^62 octets")
        elif k != want or v != want:
            raise MalformedError(
                f"container: malformed: layer {first + i} sections are {k}+{v} octets, codec 0x{codec:04x} makes {want}"
            )
        layers.append((k, v))
    return Header(codec, first, tokens, tuple(layers)), hl
