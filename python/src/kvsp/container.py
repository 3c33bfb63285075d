"""The KVB1 container's header (R-CNT-1..6, A-9), encoded and checked as
kvsp's Go container package does: every length is checked against the
model's geometry before anything is allocated."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .descriptor import ELEMENT_SIZES, Descriptor
from .digests import layer_digest
from .errors import DigestMismatchError, InvalidError

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
    codec, first, count, tokens = _parse_fixed(b, g)
    hl = header_len(count)
    if len(b) < hl:
        raise TruncatedError("container: malformed: truncated in header")
    layers = _parse_lengths(memoryview(b)[FIXED_HEADER_LEN:hl], codec, first, g)
    return Header(codec, first, tokens, layers), hl


def _parse_fixed(b: bytes | bytearray | memoryview, g: Geometry | None) -> tuple[int, int, int, int]:
    """Check the 20 fixed octets; return Codec, First Layer, Layer Count and
    Token Count."""
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
        return codec, first, count, tokens
    if first + count > g.layers:
        raise MalformedError(f"container: malformed: layers {first}..{first + count - 1} beyond the model's {g.layers}")
    if tokens != g.block_tokens:
        raise MalformedError(f"container: malformed: token count {tokens}, block_tokens is {g.block_tokens}")
    section_len(codec, g)  # a registered codec
    return codec, first, count, tokens


def _parse_lengths(b: memoryview, codec: int, first: int, g: Geometry | None) -> tuple[tuple[int, int], ...]:
    """The length pairs, each checked against the codec's section length."""
    want = section_len(codec, g) if g is not None else 0
    layers = []
    total = 0
    for i in range(len(b) // LAYER_ENTRY_LEN):
        k, v = _ENTRY.unpack_from(b, LAYER_ENTRY_LEN * i)
        if g is None:
            total += k + v
            if k > _MAX_UNKNOWN_DATA or v > _MAX_UNKNOWN_DATA or total > _MAX_UNKNOWN_DATA:
                raise MalformedError("container: malformed: section lengths past 2^62 octets")
        elif k != want or v != want:
            raise MalformedError(
                f"container: malformed: layer {first + i} sections are {k}+{v} octets, codec 0x{codec:04x} makes {want}"
            )
        layers.append((k, v))
    return tuple(layers)


class _Readable(Protocol):
    def readinto(self, b: memoryview, /) -> int | None: ...


@dataclass(frozen=True)
class Layer:
    """One layer from a :class:`Reader`: ``k`` and ``v`` are views of the
    reader's buffer, valid until the next layer is read."""

    index: int  # the layer number in the model
    k: memoryview
    v: memoryview
    digest: bytes


@dataclass
class Digests:
    layers: list[bytes]  # per layer of the container, in order
    container: bytes = b""  # SHA-256 of the whole container (Repr-Digest)


class Reader:
    """Decodes one container from a stream, layer by layer: a layer is
    yielded only once all its octets have arrived and its digest matched the
    expected one (if set), so a consumer can use layer l while l+1 is in
    flight; a stream cut inside a layer raises, never yields part of one.
    Lengths are checked against the geometry before the layer buffer is
    allocated (once); octets are read into it (``readinto``) and hashed
    through views: no copy per read."""

    def __init__(
        self,
        src: _Readable,
        g: Geometry,
        *,
        layer_digests: Sequence[bytes] | None = None,
        container_digest: bytes | None = None,
    ) -> None:
        self._src, self._g = src, g
        self._expect, self._expect_c = layer_digests, container_digest
        self._whole = hashlib.sha256()
        self.header: Header | None = None
        self.digests = Digests([])

    def _fill(self, buf: memoryview, where: str) -> None:
        got = 0
        while got < len(buf):
            n = self._src.readinto(buf[got:])
            if not n:
                raise TruncatedError(f"container: malformed: truncated in {where}")
            got += n
        self._whole.update(buf)

    def read_header(self) -> Header:
        """Read and check the header (A-9): the fixed part before the
        lengths are read, so a Layer Count past the model's allocates
        nothing."""
        if self.header is not None:
            return self.header
        self._g.validate()
        fixed = memoryview(bytearray(FIXED_HEADER_LEN))
        self._fill(fixed, "header")
        codec, first, count, tokens = _parse_fixed(fixed, self._g)
        lens = memoryview(bytearray(LAYER_ENTRY_LEN * count))
        self._fill(lens, "header")
        self.header = Header(codec, first, tokens, _parse_lengths(lens, codec, first, self._g))
        return self.header

    def __iter__(self) -> Iterator[Layer]:
        h = self.read_header()
        k_len, v_len = h.layers[0]
        buf = memoryview(bytearray(k_len + v_len))
        for i in range(h.layer_count):
            idx = h.first_layer + i
            self._fill(buf, f"layer {idx}")
            d = hashlib.sha256(buf).digest()
            if self._expect is not None and (idx >= len(self._expect) or self._expect[idx] != d):
                raise DigestMismatchError(f"container: digest mismatch: layer {idx}")
            self.digests.layers.append(d)
            yield Layer(idx, buf[:k_len], buf[k_len:], d)
        if self._src.readinto(memoryview(bytearray(1))):
            raise MalformedError("container: malformed: octets after the last layer")
        c = self._whole.digest()
        if self._expect_c is not None and c != self._expect_c:
            raise DigestMismatchError("container: digest mismatch: container")
        self.digests.container = c


class Writer:
    """Streams a container with header h to dst in ascending layer order,
    computing its layer and container digests as the octets pass."""

    def __init__(self, dst: _Writable, h: Header) -> None:
        self._dst, self._h, self._next = dst, h, 0
        self._whole = hashlib.sha256()
        self._layers: list[bytes] = []
        self._write(h.to_bytes())

    def _write(self, b: bytes | memoryview) -> None:
        self._whole.update(b)
        self._dst.write(b)

    def write_layer(self, k: bytes | memoryview, v: bytes | memoryview) -> None:
        if self._next >= self._h.layer_count:
            raise MalformedError(f"container: malformed: more than {self._h.layer_count} layers")
        want = self._h.layers[self._next]
        if (len(k), len(v)) != want:
            raise MalformedError(
                f"container: malformed: layer {self._h.first_layer + self._next} sections are "
                f"{len(k)}+{len(v)} octets, the header says {want[0]}+{want[1]}"
            )
        self._write(k)
        self._write(v)
        self._layers.append(layer_digest(k, v))
        self._next += 1

    def close(self) -> Digests:
        if self._next != self._h.layer_count:
            raise MalformedError(f"container: malformed: {self._next} of {self._h.layer_count} layers written")
        return Digests(self._layers, self._whole.digest())


class _Writable(Protocol):
    def write(self, b: bytes | memoryview, /) -> object: ...
