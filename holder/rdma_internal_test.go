package holder

import (
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// TestRDMAExposuresExpire: an exposure ends at its TTL (its block and
// registration released exactly once), earlier when its owner deletes
// it, never by another identity; one identity holds at most
// rdmaMaxPerClient.
func TestRDMAExposuresExpire(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		x := newRDMAReads()
		var released atomic.Int32
		id, ok := x.add("a", 10*time.Second, func() { released.Add(1) })
		if !ok {
			t.Fatal("refused")
		}
		time.Sleep(9 * time.Second)
		synctest.Wait()
		if released.Load() != 0 || x.end(id, "b") {
			t.Fatal("released before its TTL, or by another identity")
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if released.Load() != 1 || x.end(id, "a") {
			t.Fatalf("after its TTL: released %d times, still present %v", released.Load(), x.byID[id] != nil)
		}
		var ids []string
		for range rdmaMaxPerClient {
			id, ok := x.add("a", time.Minute, func() { released.Add(1) })
			if !ok {
				t.Fatal("refused under the limit")
			}
			ids = append(ids, id)
		}
		if _, ok := x.add("a", time.Minute, func() {}); ok {
			t.Fatal("over the per-identity limit")
		}
		if _, ok := x.add("b", time.Minute, func() { released.Add(1) }); !ok {
			t.Fatal("another identity refused")
		}
		if !x.end(ids[0], "a") || released.Load() != 2 {
			t.Fatal("DELETE by the owner")
		}
		x.closeAll()
		if released.Load() != 2+rdmaMaxPerClient {
			t.Fatalf("closeAll released %d", released.Load())
		}
	})
}
