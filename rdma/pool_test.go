package rdma

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

// TestReaderPoolRegistersOnce: reads into the Reader's buffers register
// memory once per pooled buffer, not once per read (the cost a NIC's
// registration would add to every block); released buffers are reused;
// reads into other memory, and beyond the pool's bound, still work and
// register for the read only.
func TestReaderPoolRegistersOnce(t *testing.T) {
	f := NewFabric()
	ip, hp := f.Provider("instance"), f.Provider("holder")
	target := NewTarget(hp)
	defer target.Close()
	r := NewReaderPool(ip, 4*minBufferClass)
	defer r.Close()
	src := bytes.Repeat([]byte("0123456789abcdef"), 1<<14) // 256 KiB
	const holder = "https://h1/"
	ep := connect(t, r, holder, target)
	addr, rkey, unexpose, err := target.Expose(ep, src, src)
	if err != nil {
		t.Fatal(err)
	}
	defer unexpose()
	ctx := context.Background()
	read := func(n int, off uint64) {
		t.Helper()
		buf, release, err := r.Buffer(n + 7)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		if err := r.Read(ctx, holder, buf[7:], addr+off, rkey); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf[7:], src[off:off+uint64(n)]) {
			t.Fatalf("read %d at %d: wrong octets", n, off)
		}
	}
	made0, _ := ip.Registrations()
	for i := range 50 {
		read(40<<10, uint64(i*97))
		read(100<<10, uint64(i*13))
	}
	made, live := ip.Registrations()
	if made-made0 != 2 || live != 2 {
		t.Fatalf("100 reads in two size classes: %d registrations, %d live; want 2", made-made0, live)
	}
	// Two buffers of one class at once: the pool grows to two of it.
	b1, rel1, _ := r.Buffer(1000)
	b2, rel2, _ := r.Buffer(1000)
	if &b1[0] == &b2[0] {
		t.Fatal("one pooled buffer handed out twice")
	}
	rel1()
	rel1() // a second release is a no-op
	b3, rel3, _ := r.Buffer(1000)
	if &b3[0] != &b1[0] {
		t.Fatal("a released buffer was not reused")
	}
	rel2()
	rel3()
	// Beyond the pool's bound (256 KiB, all of it held now): ordinary
	// memory, registered for each read and deregistered after.
	big, relBig, _ := r.Buffer(200 << 10)
	made1, _ := ip.Registrations()
	if err := r.Read(ctx, holder, big, addr, rkey); err != nil || !bytes.Equal(big, src[:200<<10]) {
		t.Fatalf("unpooled read: %v", err)
	}
	relBig()
	made2, live2 := ip.Registrations()
	if made2-made1 != 1 || live2 != live+1 {
		t.Fatalf("an unpooled read: %d registrations, %d live (pool: %d)", made2-made1, live2, live+1)
	}
	st := r.PoolStats()
	if st.Unpooled != 1 || st.HeldBytes != 4*minBufferClass || st.Registered != 4 {
		t.Fatalf("stats %+v", st)
	}
	r.Close()
	if _, live := ip.Registrations(); live != 0 {
		t.Fatalf("%d registrations live after Close", live)
	}
}

// TestReaderDropsFailedQueuePair: a read that failed (here the holder
// ended the exposure) takes its queue pair down, as a NIC leaves it in
// the error state; the next read connects a new one and works.
func TestReaderDropsFailedQueuePair(t *testing.T) {
	f := NewFabric()
	target := NewTarget(f.Provider("holder"))
	defer target.Close()
	r := NewReader(f.Provider("instance"))
	defer r.Close()
	src := []byte("a block's octets")
	const holder = "https://h1/"
	ep1 := connect(t, r, holder, target)
	addr, rkey, unexpose, _ := target.Expose(ep1, src, src)
	unexpose()
	buf, release, _ := r.Buffer(len(src))
	defer release()
	if err := r.Read(context.Background(), holder, buf, addr, rkey); !errors.Is(err, ErrRemoteAccess) {
		t.Fatalf("read after the exposure ended: %v", err)
	}
	ep2 := connect(t, r, holder, target)
	if ep2 == ep1 {
		t.Fatal("the failed queue pair was kept")
	}
	addr, rkey, unexpose, _ = target.Expose(ep2, src, src)
	defer unexpose()
	if err := r.Read(context.Background(), holder, buf, addr, rkey); err != nil || !bytes.Equal(buf, src) {
		t.Fatalf("read on the new queue pair: %v %q", err, buf)
	}
}
