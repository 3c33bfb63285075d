package holder

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// TestNoIndexNothingRefreshed: a holder without an Index Service stores
// and serves, and its record refresh (every third of RecordTTL) has
// nothing to call: it neither publishes nor crashes (the refresh used to
// call the missing IS client, a nil dereference RecordTTL/3 after the
// first PUT: make bench-holder's server processes died of it).
func TestNoIndexNothingRefreshed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h, err := New(Config{Base: "https://127.0.0.1/h1/", Geometries: map[kvsp.CompatID]container.Geometry{{7}: bigGeom},
			Capacity: 64 << 20, RecordTTL: 3 * time.Second, LeaseQuota: LeaseQuota{Octets: 1 << 20, MaxTTL: time.Second, MaxLeases: 1}})
		if err != nil {
			t.Fatal(err)
		}
		id := blockID{compat: kvsp.CompatID{7}, key: kvsp.BlockKey{1}}
		if _, _, _, err := h.store.put(id, bigBlock(t, h.store, 1), bigGeom); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Second) // three refresh periods
		synctest.Wait()
		if h.store.get(id) == nil {
			t.Fatal("the block is gone")
		}
		if err := h.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
}
