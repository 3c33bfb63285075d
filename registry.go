package kvsp

import "fmt"

// Values of the KVSP registries (section "IANA Considerations"). Registry
// names are lowercase ASCII and compared case-sensitively (R-REG-11).

// ElementType is a "KVSP Element Types" name: the kv_dtype of a descriptor.
type ElementType string

// The registered element types (R-REG-7).
const (
	BF16    ElementType = "bf16"
	FP16    ElementType = "fp16"
	FP32    ElementType = "fp32"
	FP8E4M3 ElementType = "fp8-e4m3"
	FP8E5M2 ElementType = "fp8-e5m2"
)

// Size returns the octets per element, or 0 for an unregistered type.
func (t ElementType) Size() int {
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

// Valid reports whether t is registered.
func (t ElementType) Valid() bool { return t.Size() != 0 }

// Tier is a "KVSP Storage Tiers" name (R-REG-9).
type Tier string

// The registered tiers.
const (
	TierDevice        Tier = "device"
	TierHost          Tier = "host"
	TierLocalStorage  Tier = "local-storage"
	TierRemoteMemory  Tier = "remote-memory"
	TierRemoteStorage Tier = "remote-storage"
)

// Valid reports whether t is registered.
func (t Tier) Valid() bool {
	switch t {
	case TierDevice, TierHost, TierLocalStorage, TierRemoteMemory, TierRemoteStorage:
		return true
	}
	return false
}

// IsStorage reports whether t is a storage tier, whose read rate bounds a
// fetch (R-PLC-5).
func (t Tier) IsStorage() bool { return t == TierLocalStorage || t == TierRemoteStorage }

// UnmarshalText accepts only registered tiers.
func (t *Tier) UnmarshalText(b []byte) error {
	switch string(b) { // the constants: no allocation per decoded record
	case "device":
		*t = TierDevice
	case "host":
		*t = TierHost
	case "local-storage":
		*t = TierLocalStorage
	case "remote-memory":
		*t = TierRemoteMemory
	case "remote-storage":
		*t = TierRemoteStorage
	default:
		return fmt.Errorf("%w: tier: not in the KVSP Storage Tiers registry", ErrInvalid)
	}
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (t Tier) MarshalText() ([]byte, error) { return []byte(t), nil }

// InstanceState is a "KVSP Instance States" name (R-REG-10, R-ST-7).
type InstanceState string

// The registered instance states.
const (
	StateActive   InstanceState = "active"
	StateDraining InstanceState = "draining"
	StateSleeping InstanceState = "sleeping"
	StateFailed   InstanceState = "failed"
)

// Valid reports whether s is registered.
func (s InstanceState) Valid() bool {
	switch s {
	case StateActive, StateDraining, StateSleeping, StateFailed:
		return true
	}
	return false
}

// UnmarshalText accepts only registered states.
func (s *InstanceState) UnmarshalText(b []byte) error {
	switch string(b) {
	case "active":
		*s = StateActive
	case "draining":
		*s = StateDraining
	case "sleeping":
		*s = StateSleeping
	case "failed":
		*s = StateFailed
	default:
		return fmt.Errorf("%w: state: not in the KVSP Instance States registry", ErrInvalid)
	}
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (s InstanceState) MarshalText() ([]byte, error) { return []byte(s), nil }

// Codec is a "KVSP Codecs" value (16 bits, R-REG-6).
type Codec uint16

// The registered codecs.
const (
	CodecReserved Codec = 0x0000
	CodecRaw      Codec = 0x0001
	// Values 0xFF00-0xFFFF are for private use (R-REG-5).
	CodecPrivateFirst Codec = 0xFF00
)

// IsPrivate reports whether c is in the private-use range.
func (c Codec) IsPrivate() bool { return c >= CodecPrivateFirst }

// LayoutRaw is the only layout defined for codec "raw" (R-CMP-12).
const LayoutRaw = "kvsp-layout-1"
