//go:build nogpu

package holder

import (
	"bytes"
	"container/list"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/tier"
)

// residenceCase makes one kind of residence holding blk (a block of
// bigGeom's layers, stored in s) for the conformance suite.
type residenceCase struct {
	name string
	make func(t *testing.T, s *store, blk *container.Block) residence
	// noRDMA: its octets cannot be exposed in place (it answers 503).
	noRDMA bool
}

// residenceCases are every kind of place a block's layers can live. A new
// kind is one file implementing residence and one line here.
var residenceCases = []residenceCase{
	{name: "host", make: func(t *testing.T, s *store, blk *container.Block) residence { return hostBlock{blk} }},
	{name: "local-storage", make: diskResidence},
	{name: "split", make: func(t *testing.T, s *store, blk *container.Block) residence { return splitResidence(t, s, blk, 2) }},
	{name: "split, all layers on the device", make: func(t *testing.T, s *store, blk *container.Block) residence { return splitResidence(t, s, blk, 4) }},
	{name: "attached", make: attachedResidence, noRDMA: true},
	{name: "paged (a test tier)", make: pagedResidence},
}

// TestResidenceConformance runs every residence through what the holder
// asks of one: a registered tier; a residency naming every layer once, in
// order, at its tier's rate; each range's body (whole, first layer, last
// layer, the middle) the container a host copy of the block gives, with
// its length and digest; the whole block materialized; and an RDMA
// exposure of exactly the range's section octets, every segment released
// at its end (or, for a kind whose octets cannot be exposed in place, a
// 503 with nothing left exposed).
func TestResidenceConformance(t *testing.T) {
	for _, c := range residenceCases {
		t.Run(c.name, func(t *testing.T) {
			s := newStore(64<<20, newLeases(LeaseQuota{}), nil)
			blk := patternBlock(t, s)
			e := newEntry(id(9), blk, bigGeom)
			r := c.make(t, s, blk)
			if !r.where().Valid() {
				t.Errorf("where() = %q: not in the KVSP Storage Tiers registry", r.where())
			}
			rt := rates{host: 1000, device: 2000, disk: 300}
			res := r.residency(bigGeom.Layers, rt)
			next := uint32(0)
			for _, x := range res {
				want := map[kvsp.Tier]uint64{kvsp.TierHost: rt.host, kvsp.TierDevice: rt.device, kvsp.TierLocalStorage: rt.disk}[x.Tier]
				if !x.Tier.Valid() || x.Layers[0] != next || x.Layers[1] < x.Layers[0] || x.ReadMbitPerS != want || want == 0 {
					t.Errorf("residency %+v: want layers from %d, a registered tier at its rate", x, next)
				}
				next = x.Layers[1] + 1
			}
			if next != bigGeom.Layers {
				t.Errorf("residency %+v covers layers 0..%d, want 0..%d", res, int(next)-1, bigGeom.Layers-1)
			}
			for _, rg := range [][2]uint32{{0, 3}, {0, 0}, {3, 3}, {1, 2}} {
				span := spanOf(e, rg[0], rg[1])
				v, _ := blk.Range(rg[0], rg[1])
				var want bytes.Buffer
				v.WriteTo(&want)
				b, err := r.body(span)
				if err != nil {
					t.Fatalf("layers %v: %v", rg, err)
				}
				var got bytes.Buffer
				n, err := b.WriteTo(&got)
				if err != nil || n != int64(got.Len()) || b.Len() != int64(want.Len()) || !bytes.Equal(got.Bytes(), want.Bytes()) {
					t.Errorf("layers %v: wrote %d octets (%v), Len %d, want the %d of the range's container", rg, n, err, b.Len(), want.Len())
				}
				if d, err := b.Digest(); err != nil || d != v.Digest() {
					t.Errorf("layers %v: digest %v (%v), want %v", rg, d, err, v.Digest())
				}
				if !bytes.Equal(span.headerBytes(), v.AppendHeader(nil)) {
					t.Errorf("layers %v: the span's header is not the range's", rg)
				}
				x := &recordingRDMA{}
				segs, end, err := r.expose(x, "client", span)
				if c.noRDMA || err != nil {
					if !c.noRDMA || !errors.Is(err, kvsp.ErrUnavailable) || x.live.Load() != 0 {
						t.Errorf("layers %v: expose: %v with %d exposures live (want a 503 and none: %v)", rg, err, x.live.Load(), c.noRDMA)
					}
					continue
				}
				var data []byte
				for _, sg := range segs {
					data = append(data, x.read(t, sg)...)
				}
				if !bytes.Equal(data, v.Data()) {
					t.Errorf("layers %v: the exposed %d octets are not the range's %d section octets", rg, len(data), len(v.Data()))
				}
				end()
				if x.live.Load() != 0 {
					t.Errorf("layers %v: %d exposures live after the end", rg, x.live.Load())
				}
			}
			m, done, err := r.materialize()
			if err != nil || !bytes.Equal(m.Bytes(), blk.Bytes()) {
				t.Errorf("materialize: %v, equal %v", err, err == nil && bytes.Equal(m.Bytes(), blk.Bytes()))
			}
			if err == nil {
				done()
			}
		})
	}
}

// patternBlock is a block of bigGeom whose every octet depends on its
// layer and position (so a range from the wrong place shows).
func patternBlock(t *testing.T, s *store) *container.Block {
	t.Helper()
	h, _ := container.NewHeader(container.CodecRaw, 0, 4, bigGeom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	sec := int(bigGeom.RawSectionLen())
	for l := range 4 {
		k, v := make([]byte, sec), make([]byte, sec)
		for i := range sec {
			k[i], v[i] = byte(l*31+i*7), byte(l*17+i*13+1)
		}
		w.WriteLayer(k, v)
	}
	w.Close()
	blk, err := container.ReadBlockInto(&buf, int64(buf.Len()), bigGeom, s.bufs.get)
	if err != nil {
		t.Fatal(err)
	}
	return blk
}

func diskResidence(t *testing.T, s *store, blk *container.Block) residence {
	d, err := tier.OpenDisk(tier.DiskConfig{Dir: t.TempDir(), Capacity: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	s.disk = d
	e := newEntry(id(9), blk, bigGeom)
	if err := d.Put(e.id.name(), blk); err != nil {
		t.Fatal(err)
	}
	s.addDisk(e)
	r, release, err := s.acquire(e, bigGeom)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(release)
	return r
}

// splitResidence stores blk with its first devLayers layers on the
// (stand-in) device.
func splitResidence(t *testing.T, s *store, blk *container.Block, devLayers int) residence {
	d, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	s.dev = &deviceTier{d: d, layers: devLayers, capacity: 64 << 20, lru: list.New()}
	e, _, _, err := s.put(id(9), blk, bigGeom)
	if err != nil {
		t.Fatal(err)
	}
	r, release, err := s.acquire(e, bigGeom)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := r.(splitBlock); !ok {
		t.Fatalf("stored in %T, not split", r)
	}
	t.Cleanup(release)
	return r
}

// attachedResidence lends blk's sections to the holder as an engine's
// pool does, one page per block, K and V of each layer a region.
func attachedResidence(t *testing.T, s *store, blk *container.Block) residence {
	d, err := tier.OpenDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	s.dev = &deviceTier{d: d, layers: 0, capacity: 64 << 20, lru: list.New()}
	sec := int64(bigGeom.RawSectionLen())
	buf, err := d.Alloc(2 * int64(bigGeom.Layers) * sec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(buf.Free)
	var regions []tier.Region
	for l := range bigGeom.Layers {
		k, v, _ := blk.Layer(l)
		off := int64(l) * 2 * sec
		buf.CopyIn(off, k)
		buf.CopyIn(off+sec, v)
		regions = append(regions, tier.Region{Off: off, Len: sec}, tier.Region{Off: off + sec, Len: sec})
	}
	a := &attachment{h: &Holder{store: s}, buf: buf, g: bigGeom}
	return attachedBlock{d: d, at: &attached{a: a, regions: regions}}
}

// recordingRDMA keeps what a residence exposes, to read it back as a
// client's READ would.
type recordingRDMA struct {
	exposed []func() []byte // by address
	live    atomic.Int64
}

func (x *recordingRDMA) Accept(string) (string, error) { return "local", nil }

func (x *recordingRDMA) add(read func() []byte) (uint64, uint32, func(), error) {
	x.exposed = append(x.exposed, read)
	x.live.Add(1)
	var once atomic.Bool
	return uint64(len(x.exposed) - 1), 7, func() {
		if once.CompareAndSwap(false, true) {
			x.live.Add(-1)
		}
	}, nil
}

func (x *recordingRDMA) Expose(client string, mem, buf []byte) (uint64, uint32, func(), error) {
	if mem != nil && !inside(mem, buf) {
		return 0, 0, nil, fmt.Errorf("buf is not in mem")
	}
	return x.add(func() []byte { return bytes.Clone(buf) })
}

func (x *recordingRDMA) ExposeDevice(client string, mem DeviceMemory, off, n uint64) (uint64, uint32, func(), error) {
	if off+n > uint64(mem.Len()) {
		return 0, 0, nil, fmt.Errorf("outside the device memory")
	}
	return x.add(func() []byte { return bytes.Clone(mem.HostBytes()[off : off+n]) })
}

func (x *recordingRDMA) read(t *testing.T, sg kvsp.RDMASegment) []byte {
	t.Helper()
	a, err := strconv.ParseUint(sg.Addr, 16, 64)
	if err != nil || a >= uint64(len(x.exposed)) || sg.RKey != 7 {
		t.Fatalf("segment %+v: not one exposed", sg)
	}
	b := x.exposed[a]()
	if uint64(len(b)) != sg.Length {
		t.Fatalf("segment %+v: %d octets exposed", sg, len(b))
	}
	return b
}

// inside reports whether buf lies in mem.
func inside(mem, buf []byte) bool {
	if len(buf) == 0 || len(mem) == 0 {
		return false
	}
	lo, a := uintptr(unsafe.Pointer(&mem[0])), uintptr(unsafe.Pointer(&buf[0]))
	return a >= lo && a+uintptr(len(buf)) <= lo+uintptr(len(mem))
}
