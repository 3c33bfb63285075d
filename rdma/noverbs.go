//go:build !rdma || !cgo

package rdma

// Enabled reports whether this build has the verbs provider.
const Enabled = false

// Verbs is the libibverbs provider; this build has none, and OpenVerbs
// says so.
type Verbs struct{}

// OpenVerbs returns ErrNotBuilt: build with -tags rdma and cgo.
func OpenVerbs(name string) (*Verbs, error) { return nil, ErrNotBuilt }

// Name implements Provider.
func (*Verbs) Name() string { return "verbs (not built)" }

// Register implements Provider.
func (*Verbs) Register([]byte, Access) (MR, error) { return nil, ErrNotBuilt }

// RegisterDevice implements Provider.
func (*Verbs) RegisterDevice(DeviceMemory, uint64, uint64, Access) (MR, error) {
	return nil, ErrNotBuilt
}

// NewQP implements Provider.
func (*Verbs) NewQP() (QP, error) { return nil, ErrNotBuilt }

// HasWindows implements Provider.
func (*Verbs) HasWindows() bool { return false }

// Close implements Provider.
func (*Verbs) Close() error { return nil }
