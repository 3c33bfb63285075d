package index_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestB9_ResponseAmplification (RELIABILITY B9): what a small request can
// make the IS send or keep is bounded before any work.
//   - A lookup repeating one key 4,096 times (275 KB in, 10.6 MB out
//     before) is 400 naming the repeat, and reaches no backend.
//   - A record with 15,000 layer digests (1 MiB, and 257 MB out for a
//     lookup naming it 256 times) is 400: for a model the IS has a
//     descriptor for, above its layers; for another, above the index's
//     bound.
//   - One holder's records stop at its quota (429); its refreshes do not.
//   - A lookup whose answer would pass max_response_bytes is 413 with the
//     bound, before it is encoded; one below it is served.
//   - After lookups with 18 MB answers, the heap in use comes back to its
//     level (answer buffers above 1 MiB are not pooled).
func TestB9_ResponseAmplification(t *testing.T) {
	known := kvsp.CompatID{0x32}
	mem := index.NewMemory(time.Second)
	defer mem.Close()
	pc := &probeCounter{Backend: mem}
	f := startIS(t, index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096, MaxHolderRecords: 252, MaxResponseBytes: 24 << 20,
		Layers: func(c kvsp.CompatID) (int, bool) { return 32, c == known }}, pc, pol2)
	ctx := context.Background()
	lookupBody := func(ks []kvsp.BlockKey) []byte {
		b, _ := kvsp.Marshal(&kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: ks})
		return b
	}
	hc := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: f.pki.ClientTLS(f.pki.Leaf(kvsptest.ClientA)), ForceAttemptHTTP2: true})
	post := func(body []byte) (int, []byte) {
		req, _ := http.NewRequest(http.MethodPost, f.srv.URL("/is/lookup"), bytes.NewReader(body))
		req.Header.Set("Content-Type", kvsp.MediaType)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	k := func(i int) kvsp.BlockKey {
		var x kvsp.BlockKey
		binary.BigEndian.PutUint32(x[:], uint32(i)+1)
		return x
	}
	// One key 4,096 times.
	r := rec(h1, 0, 3600000)
	r.BlockKey = k(0)
	if _, err := mem.Put(ctx, r, time.Hour, index.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	rep := make([]kvsp.BlockKey, 4096)
	for i := range rep {
		rep[i] = k(0)
	}
	pc.calls.Store(0)
	if st, b := post(lookupBody(rep)); st != 400 || !strings.Contains(string(b), "repeats block_keys[0]") || pc.calls.Load() != 0 {
		t.Fatalf("a lookup repeating one key: %d %.300s, %d backend calls", st, b, pc.calls.Load())
	}
	// Records larger than the geometry allows.
	h := f.client(kvsptest.Holder1)
	big := func(compat kvsp.CompatID, digests int, key kvsp.BlockKey, holder string) *kvsp.ReplicaRecord {
		x := rec(holder, 0, 3600000)
		x.BlockKey, x.CompatID = key, compat
		x.LayerDigests = make([]kvsp.LayerDigest, digests)
		x.Residency = []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, uint32(min(digests, 32)) - 1}}}
		return x
	}
	for _, c := range []struct {
		name   string
		rec    *kvsp.ReplicaRecord
		detail string
	}{
		{"15,000 layer digests, a known model of 32 layers", big(known, 15000, k(1), h1), "more than the model's 32 layers"},
		{"33 layer digests, a known model of 32 layers", big(known, 33, k(1), h1), "more than the model's 32 layers"},
		{"15,000 layer digests, an unknown model", big(kvsp.CompatID{1}, 15000, k(1), h1), "the index's bound of 1024 layers"},
	} {
		_, _, err := h.Publish(ctx, c.rec)
		var p *kvsp.Problem
		if !errors.As(err, &p) || p.Status != 400 || !strings.Contains(p.Detail, c.detail) {
			t.Fatalf("%s: %v", c.name, err)
		}
	}
	if _, _, err := h.Publish(ctx, big(known, 32, k(1), h1)); err != nil {
		t.Fatalf("a record of the model's 32 layers: %v", err)
	}
	// 250 maximal records of h1 (1,024 layer digests, ~72 KB each), with
	// its 2 above: the quota of 252; one more is refused, a refresh is not.
	ks := make([]kvsp.BlockKey, 250)
	for i := range ks {
		ks[i] = k(1000 + i)
		if _, _, err := h.Publish(ctx, big(kvsp.CompatID{1}, 1024, ks[i], h1)); err != nil {
			t.Fatalf("record %d: %v", i, err)
		}
	}
	if _, _, err := h.Publish(ctx, big(kvsp.CompatID{1}, 1024, k(5000), h1)); !errors.Is(err, kvsp.ErrTooManyRequests) {
		t.Fatalf("a record beyond the holder's quota: %v", err)
	}
	if _, _, err := h.Publish(ctx, big(kvsp.CompatID{1}, 1024, ks[0], h1)); err != nil {
		t.Fatalf("a refresh at the quota: %v", err)
	}
	// An 18 MB answer is served; the heap comes back to its level.
	level := func() uint64 {
		runtime.GC()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse
	}
	h0 := level()
	for range 4 {
		st, b := post(lookupBody(ks))
		if st != 200 || len(b) < 16<<20 {
			t.Fatalf("a lookup of 250 maximal records: %d, %d octets", st, len(b))
		}
	}
	runtime.GC() // one cycle: a pooled buffer would survive it (sync.Pool's victim cache)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	if grew := int64(ms.HeapInuse) - int64(h0); grew > 8<<20 {
		t.Fatalf("heap in use %d MiB above its level after the large answers: an answer buffer was kept", grew>>20)
	}
	// A second replica of each (h2): the answer would pass 24 MiB.
	h2c := f.client(h2ID)
	for _, key := range ks {
		if _, _, err := h2c.Publish(ctx, big(kvsp.CompatID{1}, 1024, key, h2Base)); err != nil {
			t.Fatal(err)
		}
	}
	st, b := post(lookupBody(ks))
	if st != 413 || !strings.Contains(string(b), `"max_response_octets":25165824`) {
		t.Fatalf("a lookup whose answer passes the bound: %d %.300s", st, b)
	}
	if st, _ := post(lookupBody(ks[:100])); st != 200 {
		t.Fatalf("a lookup below the bound: %d", st)
	}
}
