package rdma

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"unsafe"
)

// client is an instance's Reader connected to a Target.
type client struct {
	r  *Reader
	ep string
}

func connectClient(t *testing.T, f *Fabric, target *Target, name string) client {
	t.Helper()
	r := NewReader(f.Provider(name))
	t.Cleanup(func() { r.Close() })
	return client{r, connect(t, r, "h", target)}
}

// connect connects r's queue pair for holder to target as a holder's
// POST rdma/reads does, and returns its endpoint.
func connect(t testing.TB, r *Reader, holder string, target *Target) string {
	t.Helper()
	ep, _ := r.Endpoint(holder)
	remote, err := target.Accept(ep)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Connect(holder, ep, remote); err != nil {
		t.Fatal(err)
	}
	return ep
}

func (c client) read(addr uint64, rkey uint32, n int) ([]byte, error) {
	buf := make([]byte, n)
	return buf, c.r.Read(context.Background(), "h", buf, addr, rkey)
}

// TestTargetWindows: an exposure is a window bound for one client's queue
// pair over exactly the octets exposed: that client reads them, another
// client with the same address and key cannot, nor can the first past
// them or after the exposure ends, although the memory stays registered
// (once, for every exposure of the allocation).
func TestTargetWindows(t *testing.T) {
	f := NewFabric()
	hp := f.Provider("holder")
	target := NewTarget(hp)
	defer target.Close()
	a, b := connectClient(t, f, target, "a"), connectClient(t, f, target, "b")
	mem := make([]byte, 1<<20)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	buf := mem[4096 : 4096+65536]
	made0, _ := hp.Registrations()
	addr, rkey, release, err := target.Expose(a.ep, mem, buf)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := a.read(addr, rkey, len(buf)); err != nil || !bytes.Equal(got, buf) {
		t.Fatalf("the client the window is for: %v", err)
	}
	if _, err := b.read(addr, rkey, len(buf)); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("another client with the same key: %v, want a remote access error", err)
	}
	a = connectClient(t, f, target, "a2") // a failed read drops the pair; b's did
	addr, rkey, release2, err := target.Expose(a.ep, mem, buf)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.read(addr-1, rkey, 16); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("a read before the exposed octets: %v", err)
	}
	a = connectClient(t, f, target, "a3")
	addr, rkey, release3, err := target.Expose(a.ep, mem, buf)
	if err != nil {
		t.Fatal(err)
	}
	release3()
	release3() // a second release is a no-op
	if _, err := a.read(addr, rkey, 16); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("a read after the exposure ended: %v", err)
	}
	release()
	release2()
	made, live := hp.Registrations()
	if made-made0 != 1 || live != 1 || hp.Windows() != 0 {
		t.Fatalf("three exposures of one allocation: %d registrations, %d live, %d windows bound; want 1, 1, 0", made-made0, live, hp.Windows())
	}
	if s := target.CacheStats(); s.Registrations != 1 || s.Hits != 2 || s.HeldBytes != 1<<20 {
		t.Fatalf("cache %+v", s)
	}
	// The cached registration itself is not readable with its own key.
	m, _ := target.cache.acquire(mem)
	defer target.cache.release(m)
	r := m.mr.Region()
	b = connectClient(t, f, target, "b2")
	if _, err := b.read(r.Addr, r.RKey, 16); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("a read with the registration's key: %v, want a remote access error", err)
	}
}

// TestTargetCacheBound: idle registrations beyond the bound are
// deregistered, least recently used first; those in use are kept until
// released, however many.
func TestTargetCacheBound(t *testing.T) {
	f := NewFabric()
	hp := f.Provider("holder")
	target := NewTargetCache(hp, 2<<20)
	defer target.Close()
	c := connectClient(t, f, target, "c")
	var mems [][]byte
	for i := range 4 {
		mems = append(mems, bytes.Repeat([]byte{byte(i)}, 1<<20))
	}
	var releases []func()
	for _, m := range mems[:3] { // three in use at once, over the bound
		addr, rkey, release, err := target.Expose(c.ep, m, m)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := c.read(addr, rkey, len(m)); err != nil || !bytes.Equal(got, m) {
			t.Fatal(err)
		}
		releases = append(releases, release)
	}
	if s := target.CacheStats(); s.HeldBytes != 3<<20 {
		t.Fatalf("in use: %+v", s)
	}
	for _, r := range releases {
		r()
	}
	if _, live := hp.Registrations(); live != 2 {
		t.Fatalf("after release: %d registrations live, want 2 (the bound)", live)
	}
	// mems[0] was the least recently used: exposing it registers again,
	// mems[2] is still registered.
	_, _, r2, _ := target.Expose(c.ep, mems[2], mems[2])
	r2()
	made0, _ := hp.Registrations()
	_, _, r0, _ := target.Expose(c.ep, mems[0], mems[0])
	r0()
	if made, live := hp.Registrations(); made != made0+1 || live != 2 {
		t.Fatalf("re-exposing an evicted allocation: %d new registrations, %d live", made-made0, live)
	}
	if _, _, _, err := target.Expose(c.ep, mems[0], mems[1]); err == nil {
		t.Fatal("octets outside the memory given were exposed")
	}
	if _, _, _, err := target.Expose("v1.0001.000001.000001.00000000000000000000000000000000", mems[0], mems[0]); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("an endpoint never accepted: %v", err)
	}
}

// noWindows is a provider whose device has no type 2 windows.
type noWindows struct{ *Loopback }

type noWindowsQP struct{ QP }

func (p noWindows) NewQP() (QP, error) {
	q, err := p.Loopback.NewQP()
	return noWindowsQP{q}, err
}

func (noWindowsQP) Bind(MR, uint64, uint64) (Window, error) { return nil, ErrNoWindows }

func (noWindows) HasWindows() bool { return false }

// claimsWindows says it has windows, but binding one fails as on a
// device without them.
type claimsWindows struct{ noWindows }

func (claimsWindows) HasWindows() bool { return true }

// TestTargetWithoutWindows: on a device without windows each exposure
// registers its octets for remote read and deregisters them when it ends
// (also when only the first bind finds out: the cached registration is
// dropped).
func TestTargetWithoutWindows(t *testing.T) {
	for name, tc := range map[string]struct {
		p    func(*Loopback) Provider
		made int64
	}{
		"says so":          {func(l *Loopback) Provider { return noWindows{l} }, 3},
		"found by binding": {func(l *Loopback) Provider { return claimsWindows{noWindows{l}} }, 4},
	} {
		t.Run(name, func(t *testing.T) {
			f := NewFabric()
			lp := f.Provider("holder")
			target := NewTarget(tc.p(lp))
			defer target.Close()
			c := connectClient(t, f, target, "c")
			mem := bytes.Repeat([]byte("kv"), 1<<12)
			for range 3 {
				addr, rkey, release, err := target.Expose(c.ep, mem, mem[2:100])
				if err != nil {
					t.Fatal(err)
				}
				if got, err := c.read(addr, rkey, 98); err != nil || !bytes.Equal(got, mem[2:100]) {
					t.Fatal(err)
				}
				release()
				if _, err := c.read(addr, rkey, 98); !errors.Is(err, ErrRemoteAccess) {
					t.Fatalf("after release: %v", err)
				}
				c = connectClient(t, f, target, "c")
			}
			if made, live := lp.Registrations(); made != tc.made || live != 0 {
				t.Fatalf("%d registrations made, %d live; want %d, 0", made, live, tc.made)
			}
		})
	}
}

// hostDevice is device memory that is host memory (as the nogpu
// stand-in's is); gpuDevice is a GPU's, which only a NIC reads.
type hostDevice []byte

func (d hostDevice) DevicePtr() uint64 { return uint64(uintptr(unsafe.Pointer(&d[0]))) }
func (d hostDevice) HostBytes() []byte { return d }
func (d hostDevice) Len() int64        { return int64(len(d)) }
func (d hostDevice) Dmabuf() (int, uint64, uint64, error) {
	return -1, 0, 0, errors.New("host memory")
}

type gpuDevice struct{ hostDevice }

func (gpuDevice) HostBytes() []byte { return nil }

// TestTargetExposeDevice: device memory is exposed for the one client
// over exactly the octets asked, registered for the exposure only (the
// device tier frees and reuses its memory without telling); memory only
// a NIC can read is refused by the in-process fabric, clearly.
func TestTargetExposeDevice(t *testing.T) {
	f := NewFabric()
	hp := f.Provider("holder")
	target := NewTarget(hp)
	defer target.Close()
	a, b := connectClient(t, f, target, "a"), connectClient(t, f, target, "b")
	mem := hostDevice(bytes.Repeat([]byte("device"), 1000))
	addr, rkey, release, err := target.ExposeDevice(a.ep, mem, 600, 1200)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := a.read(addr, rkey, 1200); err != nil || !bytes.Equal(got, mem[600:1800]) {
		t.Fatalf("the exposed octets: %v", err)
	}
	if _, err := b.read(addr, rkey, 16); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("another client: %v", err)
	}
	release()
	if _, live := hp.Registrations(); live != 0 || hp.Windows() != 0 {
		t.Fatalf("after release: %d registrations live, %d windows", live, hp.Windows())
	}
	if _, _, _, err := target.ExposeDevice(a.ep, mem, 5000, 1001); err == nil {
		t.Fatal("octets past the memory were exposed")
	}
	if _, _, _, err := target.ExposeDevice(a.ep, gpuDevice{mem}, 0, 16); err == nil || !strings.Contains(err.Error(), "NIC") {
		t.Fatalf("GPU memory on the loopback fabric: %v", err)
	}
}

// TestTargetPeersBounded: clients come back with new queue pairs without
// saying so; at the bound the least recently used pair with no exposure
// under way is closed for the new one, and a target whose pairs are all
// busy refuses.
func TestTargetPeersBounded(t *testing.T) {
	f := NewFabric()
	target := NewTarget(f.Provider("holder"))
	target.maxPeers = 3
	defer target.Close()
	cs := []client{connectClient(t, f, target, "a"), connectClient(t, f, target, "b"), connectClient(t, f, target, "c")}
	mem := bytes.Repeat([]byte("x"), 4096)
	var releases []func()
	for _, c := range cs[1:] { // b and c have reads under way; a is idle
		_, _, release, err := target.Expose(c.ep, mem, mem)
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, release)
	}
	d := connectClient(t, f, target, "d") // takes a's place
	addr, rkey, release, err := target.Expose(d.ep, mem, mem)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := d.read(addr, rkey, 4096); err != nil || !bytes.Equal(got, mem) {
		t.Fatalf("the new client: %v", err)
	}
	if _, _, _, err := target.Expose(cs[0].ep, mem, mem); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("the evicted client: %v", err)
	}
	r := NewReader(f.Provider("e"))
	defer r.Close()
	ep, _ := r.Endpoint("h")
	if _, err := target.Accept(ep); err == nil {
		t.Fatal("a fourth client was accepted while the three had reads under way")
	}
	release()
	for _, rel := range releases {
		rel()
	}
	if _, err := target.Accept(ep); err != nil {
		t.Fatalf("once idle: %v", err)
	}
}

// TestReaderConnectChecksItsPair: a holder's answer names the pair it was
// for; if that pair was dropped meanwhile (a concurrent failed read), it
// is not connected in its place; a holder answering from another pair
// than before (it restarted) has the pair dropped, and the next read
// connects a new one. RC pairs read only from their own peer.
func TestReaderConnectChecksItsPair(t *testing.T) {
	f := NewFabric()
	target := NewTarget(f.Provider("holder"))
	defer target.Close()
	r := NewReader(f.Provider("instance"))
	defer r.Close()
	ep1, _ := r.Endpoint("h")
	remote1, _ := target.Accept(ep1)
	r.Forget("h") // as a failed read does
	ep2, _ := r.Endpoint("h")
	if err := r.Connect("h", ep1, remote1); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("an answer for a dropped pair: %v", err)
	}
	remote2, _ := target.Accept(ep2)
	if err := r.Connect("h", ep2, remote2); err != nil {
		t.Fatal(err)
	}
	restarted := NewTarget(f.Provider("holder-again"))
	defer restarted.Close()
	remote3, _ := restarted.Accept(ep2)
	if err := r.Connect("h", ep2, remote3); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("a restarted holder: %v", err)
	}
	if ep3, _ := r.Endpoint("h"); ep3 == ep2 {
		t.Fatal("the pair of the restarted holder was kept")
	}
	// A pair connected to a peer that is connected elsewhere reads nothing.
	x, y, z := f.Provider("x"), f.Provider("y"), f.Provider("z")
	qx, _ := x.NewQP()
	qy, _ := y.NewQP()
	qz, _ := z.NewQP()
	qx.Connect(qy.Endpoint())
	qy.Connect(qz.Endpoint())
	src := []byte("octets")
	smr, _ := y.Register(src, AccessRemoteRead)
	dmr, _ := x.Register(make([]byte, 6), AccessLocal)
	if err := qx.Read(context.Background(), dmr, 0, smr.Region()); !errors.Is(err, ErrNotConnected) {
		t.Fatalf("a read over a half-paired connection: %v", err)
	}
}

// memlocked is a provider whose registrations fail beyond a number live,
// as ibv_reg_mr does at the locked-memory limit.
type memlocked struct {
	*Loopback
	max int
}

func (p memlocked) Register(buf []byte, access Access) (MR, error) {
	if _, live := p.Registrations(); live >= p.max {
		return nil, errors.New("ibv_reg_mr: cannot allocate memory")
	}
	return p.Loopback.Register(buf, access)
}

// TestTargetShedsAtTheLimit: a registration refused (the locked-memory
// limit) lets the idle cached ones go and is tried once more, rather than
// failing every new read while idle registrations hold the memory.
func TestTargetShedsAtTheLimit(t *testing.T) {
	f := NewFabric()
	hp := f.Provider("holder")
	target := NewTarget(memlocked{hp, 2})
	defer target.Close()
	c := connectClient(t, f, target, "c")
	for i := range 5 {
		mem := bytes.Repeat([]byte{byte(i)}, 8192)
		addr, rkey, release, err := target.Expose(c.ep, mem, mem)
		if err != nil {
			t.Fatalf("allocation %d: %v", i, err)
		}
		if got, err := c.read(addr, rkey, len(mem)); err != nil || !bytes.Equal(got, mem) {
			t.Fatalf("allocation %d: %v", i, err)
		}
		release()
	}
	if _, live := hp.Registrations(); live > 2 {
		t.Fatalf("%d registrations live past the limit", live)
	}
}
