"""kvsp's private-use codec 0xFF01, "kvsp-fp8-e4m3-head", bit for bit as the
Go container package computes it: each section holds kv_heads float32
scales (little-endian), then the block's elements in kvsp-layout-1 order as
FP8 E4M3 codes; the scale of head h is max|x|/448 over that head's
elements, so every element is in range.

Go computes in float32. Python's floats are doubles; every float32 step here
is a double operation rounded once to float32 (``_f32``), which gives the
float32 result exactly for +, -, x and / (a double has more than twice
float32's precision plus two bits, so the double rounding is innocuous)."""

from __future__ import annotations

import math
import struct

from .container import CODEC_FP8_HEAD, Geometry, MalformedError, UnsupportedCodecError, section_len

FP8_E4M3_MAX = 448.0
_F32 = struct.Struct("<f")
_U32 = struct.Struct("<I")


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (infinity past its range)."""
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def _bits(f: float) -> int:
    return int(_U32.unpack(_F32.pack(f))[0])


def _from_bits(b: int) -> float:
    return float(_F32.unpack(_U32.pack(b))[0])


def _bf16_to_f32(h: int) -> float:
    return _from_bits(h << 16)


def _f32_to_bf16(f: float) -> int:
    b = _bits(f)
    if b & 0x7FFFFFFF > 0x7F800000:  # NaN: keep it a NaN
        return (b >> 16) | 0x40
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def _fp16_to_f32(h: int) -> float:
    sign = (h >> 15) << 31
    exp = (h >> 10) & 0x1F
    man = h & 0x3FF
    if exp == 0:
        if man == 0:
            return _from_bits(sign)
        f = _f32(man * (1.0 / (1 << 24)))
        return -f if sign else f
    if exp == 0x1F:
        return _from_bits(sign | 0x7F800000 | man << 13)
    return _from_bits(sign | (exp + 112) << 23 | man << 13)


def _f32_to_fp16(f: float) -> int:
    b = _bits(f)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        return sign | 0x7E00
    if a >= 0x477FF000:  # rounds to >= 65520: infinity
        return sign | 0x7C00
    if a < 0x38800000:  # below 2^-14: subnormal or zero
        v = _f32(_from_bits(a) * (1 << 24))
        return sign | round(v)
    r = a - (112 << 23)
    r += 0xFFF + ((r >> 13) & 1)
    return sign | ((r >> 13) & 0xFFFF)


def _fp8_table() -> list[float]:
    t = []
    for i in range(256):
        sign = -1.0 if i & 0x80 else 1.0
        exp = (i >> 3) & 0xF
        man = float(i & 7)
        if exp == 0xF and i & 7 == 7:
            t.append(math.nan)
        elif exp == 0:
            t.append(_f32(sign * man / 8 * (1.0 / 64)))
        else:
            t.append(_f32(sign * (1 + man / 8) * math.ldexp(1, exp - 7)))
    return t


_FP8 = _fp8_table()


def _f32_to_fp8(f: float) -> int:
    """Round to nearest even, saturating at +-448 (E4M3 "fn")."""
    sign = 0
    if f < 0 or (f == 0 and math.copysign(1, f) < 0):
        sign, f = 0x80, -f
    if f != f:
        return sign | 0x7F
    if f >= FP8_E4M3_MAX:
        return sign | 0x7E
    if f < 1.0 / 64:  # subnormal, step 2^-9
        return sign | round(f * 512)
    frac, exp = math.frexp(f)
    e = exp - 1
    m = round((2 * frac - 1) * 8)
    if m == 8:
        m, e = 0, e + 1
    if e > 8 or (e == 8 and m == 7):
        return sign | 0x7E
    return sign | (e + 7) << 3 | m


def _load(elem: str, raw: bytes | memoryview, i: int) -> float:
    if elem == "bf16":
        return _bf16_to_f32(raw[2 * i] | raw[2 * i + 1] << 8)
    if elem == "fp16":
        return _fp16_to_f32(raw[2 * i] | raw[2 * i + 1] << 8)
    return float(_F32.unpack_from(raw, 4 * i)[0])


def _store(elem: str, out: bytearray, i: int, f: float) -> None:
    if elem == "bf16":
        out[2 * i : 2 * i + 2] = _f32_to_bf16(f).to_bytes(2, "little")
    elif elem == "fp16":
        out[2 * i : 2 * i + 2] = _f32_to_fp16(f).to_bytes(2, "little")
    else:
        out[4 * i : 4 * i + 4] = _F32.pack(f)


def _check(g: Geometry, raw_len: int, section: int) -> None:
    if g.elem not in ("bf16", "fp16", "fp32"):
        raise UnsupportedCodecError(
            f"container: unsupported codec: {g.elem} elements cannot be transcoded to fp8 scales"
        )
    if raw_len != g.raw_section_len() or section != section_len(CODEC_FP8_HEAD, g):
        raise MalformedError("container: malformed: section lengths do not match the geometry")


def fp8_from_raw(raw: bytes | memoryview, g: Geometry) -> bytes:
    """A raw K or V section as the codec's section."""
    _check(g, len(raw), section_len(CODEC_FP8_HEAD, g))
    heads, dim, tokens = g.kv_heads, g.head_dim, g.block_tokens
    out = bytearray(section_len(CODEC_FP8_HEAD, g))
    codes = 4 * heads
    for h in range(heads):
        m = 0.0
        for t in range(tokens):
            base = (t * heads + h) * dim
            for d in range(dim):
                x = _load(g.elem, raw, base + d)
                if x != x or math.isinf(x):
                    raise MalformedError("container: malformed: non-finite element")
                m = max(m, abs(x))
        s = _f32(m / FP8_E4M3_MAX)
        out[4 * h : 4 * h + 4] = _F32.pack(s)
        inv = _f32(1 / s) if s > 0 else 0.0
        for t in range(tokens):
            base = (t * heads + h) * dim
            for d in range(dim):
                out[codes + base + d] = _f32_to_fp8(_f32(_load(g.elem, raw, base + d) * inv))
    return bytes(out)


def fp8_to_raw(section: bytes | memoryview, g: Geometry) -> bytes:
    """The codec's section back as a raw K or V section."""
    _check(g, g.raw_section_len(), len(section))
    heads, dim = g.kv_heads, g.head_dim
    out = bytearray(g.raw_section_len())
    scales = [float(_F32.unpack_from(section, 4 * h)[0]) for h in range(heads)]
    codes = section[4 * heads :]
    for i, c in enumerate(codes):
        _store(g.elem, out, i, _f32(_FP8[c] * scales[(i // dim) % heads]))
    return bytes(out)
