package instance_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestB5_OversizedLookupAndPrefetch (RELIABILITY B5; spec "quotas ...
// lookup size are REQUIRED"): a lookup of 10^6 block keys at the IS and a
// prefetch directive of 10^5 blocks at an instance, each streamed so the
// sender holds nothing: 413 problem details, the server allocates far
// less than the body (under 64 MiB while it is sent), and both stay
// responsive.
func TestB5_OversizedLookupAndPrefetch(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	keyHex := func(i int) string { return fmt.Sprintf("%064x", i+1) }
	for _, tc := range []struct {
		name, id, url string
		head, tail    string
		n             int
		item          func(i int) string
	}{
		{"lookup of 10^6 keys", kvsptest.ClientA, w.isURL + "lookup",
			`{"scope_id":"` + w.scopeKey.ID().String() + `","compat_id":"` + w.compat.String() + `","block_keys":[`, `]}`, 1_000_000,
			func(i int) string { return `"` + keyHex(i) + `"` }},
		{"prefetch of 10^5 blocks", kvsptest.PC, w.url("/ii1/prefetch"),
			`{"directive":"` + kvsp.NewUUID().String() + `","scope_id":"` + w.scopeKey.ID().String() + `","compat_id":"` + w.compat.String() +
				`","deadline_ms":1000,"lease_ms":1000,"layer_order":"ascending","blocks":[`, `]}`, 100_000,
			func(i int) string {
				return `{"block_key":"` + keyHex(i) + `","sources":["` + w.url("/h1/") + `"]}`
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr, pw := io.Pipe()
			go func() {
				bw := bufio.NewWriterSize(pw, 64<<10)
				bw.WriteString(tc.head)
				for i := range tc.n {
					if i > 0 {
						bw.WriteByte(',')
					}
					if _, err := bw.WriteString(tc.item(i)); err != nil {
						break // the server stopped reading
					}
				}
				bw.WriteString(tc.tail)
				pw.CloseWithError(bw.Flush())
			}()
			hc := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: w.tls(tc.id)})
			req, _ := http.NewRequest(http.MethodPost, tc.url, pr)
			req.Header.Set("Content-Type", kvsp.MediaType)
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			resp, err := hc.Do(req)
			runtime.ReadMemStats(&after)
			pr.CloseWithError(io.ErrClosedPipe)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusRequestEntityTooLarge || resp.Header.Get("Content-Type") != "application/problem+json" {
				t.Fatalf("%d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), body)
			}
			if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
				t.Fatalf("%d MiB allocated while the oversized body was refused", grew>>20)
			}
			t.Logf("413 after %d MiB allocated in the process", (after.TotalAlloc-before.TotalAlloc)>>20)
		})
	}
	// Both still answer.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, prompt(1))
	if _, err := w.front.Index(w.isURL).Lookup(ctx, &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys}); err != nil {
		t.Fatalf("a lookup after: %v", err)
	}
	if _, err := w.pc.Prefetch(ctx, w.directive(keys, func(int) []string { return []string{w.url("/h1/")} }, 200)); err != nil {
		t.Fatalf("a directive after: %v", err)
	}
}
