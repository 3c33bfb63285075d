package gpu

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"testing"
)

// openDevice opens device 0: the nogpu stand-in, or a real CUDA device.
// Without one the test is skipped, saying why, unless KVSP_REQUIRE_GPU=1
// (the GPU check script sets it), where it fails.
func openDevice(t testing.TB) *Device {
	t.Helper()
	d, err := Open(0)
	if err != nil {
		if errors.Is(err, ErrNoDevice) && os.Getenv("KVSP_REQUIRE_GPU") != "1" {
			t.Skipf("no device here (%v); this test runs on the GPU check", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	t.Logf("device 0: %s (stand-in: %v, %d MiB)", d.Info().Name, d.Info().StandIn, d.Info().Memory>>20)
	return d
}

func random(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// TestDeviceCopies: synchronous copies at offsets, device-to-device
// copies, asynchronous copies through driver-pinned and registered Go
// memory on streams, refusal of copies outside a buffer, and Free/Close
// once. The same test runs on the stand-in (make test) and on a GPU.
func TestDeviceCopies(t *testing.T) {
	d := openDevice(t)
	const n = 4 << 20
	b, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	src := random(n/2, 1)
	if err := b.CopyIn(4096, src); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if err := b.CopyOut(got, 4096); err != nil || !bytes.Equal(got, src) {
		t.Fatalf("sync round trip: %v", err)
	}
	if b.CopyIn(n-10, src) == nil || b.CopyOut(got, -1) == nil {
		t.Fatal("a copy outside the buffer was accepted")
	}
	c, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free()
	if err := c.CopyFrom(0, b, 4096, int64(len(src))); err != nil {
		t.Fatal(err)
	}
	clear(got)
	if err := c.CopyOut(got, 0); err != nil || !bytes.Equal(got, src) {
		t.Fatalf("device-to-device: %v", err)
	}

	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	h, err := d.AllocHost(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Free()
	goMem := random(1<<20, 2)
	reg, err := d.Register(goMem)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()
	// registered Go memory -> device -> pinned host
	if err := c.CopyInAsync(1<<20, reg, 0, 1<<20, s); err != nil {
		t.Fatal(err)
	}
	if err := c.CopyOutAsync(h, 0, 1<<20, 1<<20, s); err != nil {
		t.Fatal(err)
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(h.Bytes(), goMem) {
		t.Fatal("asynchronous round trip through pinned memory differs")
	}
	if c.CopyOutAsync(h, 1, 0, 1<<20, s) == nil {
		t.Fatal("an asynchronous copy past the host buffer was accepted")
	}
	if _, err := d.Alloc(d.Info().Memory * 4); !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("allocation beyond the device: %v", err)
	}
	h.Free()
	h.Free()
	reg.Unregister()
	reg.Unregister()
}

// TestStager: WriteTo delivers the regions in order, split at the staging
// size, byte for byte (the copy of the next piece overlapping the write of
// this one); Upload queues copies and Flush completes them; a write error
// stops the stream with nothing left in flight.
func TestStager(t *testing.T) {
	d := openDevice(t)
	const n = 8 << 20
	b, err := d.Alloc(n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	st, err := d.NewStager(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	data := random(n, 3)
	for off := 0; off < n; off += 700 << 10 { // uploads of pieces that are not the staging size
		end := min(n, off+700<<10)
		if err := st.Upload(b, int64(off), data[off:end]); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Flush(); err != nil {
		t.Fatal(err)
	}
	regions := []Region{{0, 100}, {3 << 20, 2<<20 + 5}, {100, 1 << 20}, {n - 1, 1}}
	var want, got []byte
	for _, r := range regions {
		want = append(want, data[r.Off:r.Off+r.Len]...)
	}
	pieces := 0
	err = st.WriteTo(b, regions, func(p []byte) error {
		if int64(len(p)) > st.Size() {
			t.Errorf("a piece of %d octets", len(p))
		}
		pieces++
		got = append(got, p...)
		return nil
	})
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("WriteTo: %v, %d of %d octets equal", err, len(got), len(want))
	}
	if pieces != 1+3+1+1 {
		t.Fatalf("%d pieces, want 6 (a region larger than the staging is split)", pieces)
	}
	stop := errors.New("peer gone")
	calls := 0
	if err := st.WriteTo(b, []Region{{0, n}}, func([]byte) error { calls++; return stop }); !errors.Is(err, stop) || calls != 1 {
		t.Fatalf("write error: %v after %d calls", err, calls)
	}
	if st.WriteTo(b, []Region{{n - 1, 2}}, func([]byte) error { return nil }) == nil {
		t.Fatal("a region outside the buffer was accepted")
	}
}

// TestTelemetry: the device reports its memory (its use grows with an
// allocation) and says where the figures come from.
func TestTelemetry(t *testing.T) {
	d := openDevice(t)
	before, err := d.Telemetry()
	if err != nil || before.MemoryTotal <= 0 || before.Source == "" {
		t.Fatalf("telemetry %+v %v", before, err)
	}
	b, err := d.Alloc(64 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	after, _ := d.Telemetry()
	if after.MemoryUsed < before.MemoryUsed+32<<20 {
		t.Fatalf("memory used %d after a 64 MiB allocation, was %d", after.MemoryUsed, before.MemoryUsed)
	}
	t.Logf("telemetry (%s): %d/%d MiB used, host link %d Mbit/s", after.Source, after.MemoryUsed>>20, after.MemoryTotal>>20, after.LinkMbitPerS)
}

// TestPCIeRates: the payload rate of PCIe links by generation and width.
func TestPCIeRates(t *testing.T) {
	for _, c := range []struct {
		gen, width int
		want       uint64
	}{{1, 1, 2000}, {3, 16, 126030}, {4, 16, 252061}, {5, 16, 504123}, {6, 16, 944000}, {0, 16, 0}, {7, 16, 0}} {
		if got := pcieMbitPerS(c.gen, c.width); got != c.want {
			t.Errorf("gen %d x%d: %d Mbit/s, want %d", c.gen, c.width, got, c.want)
		}
	}
}

// TestTwoDevicesOneOrdinal: two Devices of one ordinal (a holder's device
// tier and a connected engine on the same GPU) share its context, and
// closing one leaves the other's memory alone; on CUDA, memory of a
// closed Device is refused rather than used in a context opened since.
func TestTwoDevicesOneOrdinal(t *testing.T) {
	d1 := openDevice(t)
	d2, err := Open(0)
	if err != nil {
		t.Fatal(err)
	}
	want := random(1<<20, 7)
	b, err := d2.Alloc(int64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.CopyIn(0, want); err != nil {
		t.Fatal(err)
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if err := b.CopyOut(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the other Device's memory after one closed: %v", err)
	}
	b.Free()
	c, err := d2.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := d2.Close(); err != nil {
		t.Fatal(err)
	}
	if !d2.Info().StandIn {
		if err := c.CopyIn(0, want[:4096]); err == nil {
			t.Fatal("a copy into memory of a closed Device was accepted")
		}
	}
}
