package container

import "math"

// ElemType is an element type of the "KVSP Element Types" registry, as the
// container needs it: its size and its conversion to and from float32.
type ElemType uint8

// The registered element types.
const (
	BF16 ElemType = iota + 1
	FP16
	FP32
	FP8E4M3
	FP8E5M2
)

// ParseElemType maps a registry name ("bf16", ...) to an ElemType.
func ParseElemType(name string) (ElemType, bool) {
	switch name {
	case "bf16":
		return BF16, true
	case "fp16":
		return FP16, true
	case "fp32":
		return FP32, true
	case "fp8-e4m3":
		return FP8E4M3, true
	case "fp8-e5m2":
		return FP8E5M2, true
	}
	return 0, false
}

// Size returns the octets per element, 0 for an unknown type.
func (t ElemType) Size() int {
	switch t {
	case BF16, FP16:
		return 2
	case FP32:
		return 4
	case FP8E4M3, FP8E5M2:
		return 1
	}
	return 0
}

func (t ElemType) String() string {
	return [...]string{"invalid", "bf16", "fp16", "fp32", "fp8-e4m3", "fp8-e5m2"}[min(int(t), 5)]
}

// bf16 is the upper half of a float32.

func bf16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

func f32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it a NaN
		return uint16(b>>16) | 0x40
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16) // round to nearest even
}

// IEEE 754 binary16.

func fp16ToF32(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch exp {
	case 0:
		if man == 0 {
			return math.Float32frombits(sign)
		}
		// subnormal: man x 2^-24
		f := float32(man) * (1.0 / (1 << 24))
		if sign != 0 {
			f = -f
		}
		return f
	case 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	}
	return math.Float32frombits(sign | (exp+112)<<23 | man<<13)
}

func f32ToFP16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	a := b & 0x7fffffff
	switch {
	case a > 0x7f800000: // NaN
		return sign | 0x7e00
	case a >= 0x477ff000: // rounds to >= 65520: infinity
		return sign | 0x7c00
	case a < 0x38800000: // below 2^-14: subnormal or zero
		// value / 2^-24, rounded to nearest even
		v := math.Float32frombits(a) * (1 << 24)
		return sign | uint16(math.RoundToEven(float64(v)))
	}
	// normal: rebias exponent 127 -> 15, round mantissa 23 -> 10 bits
	r := a - (112 << 23)
	r += 0xfff + (r>>13)&1
	return sign | uint16(r>>13)
}

// FP8 E4M3 ("fn": no infinities, 0x7f and 0xff are NaN, max 448).

// fp8e4m3Max is the largest finite E4M3 value.
const fp8e4m3Max = 448

var fp8e4m3Table = func() (t [256]float32) {
	for i := range t {
		sign := float32(1)
		if i&0x80 != 0 {
			sign = -1
		}
		exp := (i >> 3) & 0xf
		man := float32(i & 7)
		switch {
		case exp == 0xf && i&7 == 7:
			t[i] = float32(math.NaN())
		case exp == 0:
			t[i] = sign * man / 8 * (1.0 / 64) // man x 2^-9
		default:
			t[i] = sign * (1 + man/8) * float32(math.Ldexp(1, exp-7))
		}
	}
	return t
}()

func fp8e4m3ToF32(b uint8) float32 { return fp8e4m3Table[b] }

// f32ToFP8E4M3 rounds to nearest even, saturating at +-448.
func f32ToFP8E4M3(f float32) uint8 {
	var sign uint8
	if f < 0 || (f == 0 && math.Signbit(float64(f))) {
		sign, f = 0x80, -f
	}
	switch {
	case f != f:
		return sign | 0x7f
	case f >= fp8e4m3Max:
		return sign | 0x7e
	case f < 1.0/64: // below the smallest normal 2^-6: subnormal, step 2^-9
		m := math.RoundToEven(float64(f) * 512)
		return sign | uint8(m) // m == 8 is exactly the smallest normal
	}
	frac, exp := math.Frexp(float64(f)) // f = frac x 2^exp, frac in [0.5, 1)
	e := exp - 1                        // f = (2 frac) x 2^e, e in -6..8
	m := math.RoundToEven((2*frac - 1) * 8)
	if m == 8 {
		m, e = 0, e+1
	}
	if e > 8 || (e == 8 && m == 7) {
		return sign | 0x7e
	}
	return sign | uint8(e+7)<<3 | uint8(m)
}
