package instance_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
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

// TestB10_SamplerParameters (RELIABILITY B10): place, generate and a
// resume's checkpoint with a sampler out of range (top-p with p <= 0, p
// > 1, p a string, no p; an unknown method; a parameter greedy does not
// take; a seed above 2^53-1): 400 problem details naming the member,
// never a reset stream; nothing placed, started or resumed, and the
// instance still serves (a top-p p <= 0 made the engine's sampler index
// out of range).
func TestB10_SamplerParameters(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	samplers := []struct {
		name   string
		json   string
		member string
	}{
		{"p zero", `{"method":"top-p","params":{"p":0},"seed":1}`, "params.p"},
		{"p negative", `{"method":"top-p","params":{"p":-0.5},"seed":1}`, "params.p"},
		{"p above one", `{"method":"top-p","params":{"p":1.5},"seed":1}`, "params.p"},
		{"p a string", `{"method":"top-p","params":{"p":"NaN"},"seed":1}`, "params.p"},
		{"p absent", `{"method":"top-p","params":{},"seed":1}`, "params.p"},
		{"unknown method", `{"method":"beam","seed":1}`, "method"},
		{"greedy with p", `{"method":"greedy","params":{"p":0.5},"seed":1}`, "params"},
		{"seed above 2^53-1", `{"method":"greedy","seed":9007199254740993}`, "seed"},
	}
	scope, compat := w.scopeKey.ID().String(), w.compat.String()
	sessions := len(w.ctl.Sessions())
	for _, s := range samplers {
		for _, c := range []struct {
			route, id, url, body string
		}{
			{"place", kvsptest.ClientA, w.url("/pc/place"),
				`{"scope_id":"` + scope + `","compat_id":"` + compat + `","tokens":[1,2,3],"max_tokens":4,"sampler":` + s.json + `}`},
			{"generate", kvsptest.ClientA, w.url("/ii1/generate"),
				`{"session":"` + kvsp.NewUUID().String() + `","epoch":1,"scope_id":"` + scope + `","compat_id":"` + compat + `","tokens":[1,2,3],"max_tokens":4,"sampler":` + s.json + `}`},
		} {
			st, body := w.rawBody(t, c.id, c.url, c.body)
			if st != 400 || !bytes.Contains(body, []byte("sampler."+s.member)) || !bytes.Contains(body, []byte(`"status":400`)) {
				t.Errorf("%s, %s: %d %s; want 400 naming sampler.%s", c.route, s.name, st, body, s.member)
			}
		}
		// A resume whose checkpoint carries the sampler (its params and
		// seed as a checkpoint holds them).
		var sp struct {
			Method string         `json:"method"`
			Params map[string]any `json:"params"`
			Seed   uint64         `json:"seed"`
		}
		if err := json.Unmarshal([]byte(s.json), &sp); err != nil {
			t.Fatal(err)
		}
		if sp.Params == nil {
			sp.Params = map[string]any{}
		}
		id := kvsp.NewUUID()
		params, _ := json.Marshal(sp.Params)
		body := `{"epoch":2,"checkpoint":{"session":"` + id.String() + `","epoch":1,"compat_id":"` + compat + `","scope_id":"` + scope +
			`","prompt_blocks":[],"prompt_tail":[9],"generated":[],"output_offset":0,"sampler":{"method":"` + sp.Method + `","params":` + string(params) +
			`,"seed":` + strconv.FormatUint(sp.Seed, 10) + `,"step":0,"deterministic":false}}}`
		st, got := w.rawBody(t, kvsptest.PC, w.url("/ii1/sessions/"+id.String()+"/resume"), body)
		if st != 400 || !bytes.Contains(got, []byte("sampler")) {
			t.Errorf("resume, %s: %d %s; want 400 naming the sampler", s.name, st, got)
		}
		// Nothing was resumed: a generate at the new epoch finds no session.
		gen, err := kvsp.Marshal(w.granted(t, &kvsp.GenerateRequest{Session: id, Epoch: 2, ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: []uint32{9}, MaxTokens: 2}))
		if err != nil {
			t.Fatal(err)
		}
		if st, got := w.rawBody(t, kvsptest.ClientA, w.url("/ii1/generate"), string(gen)); st != 404 {
			t.Errorf("resume, %s: the refused resume left a session (%d %s)", s.name, st, got)
		}
	}
	if n := len(w.ctl.Sessions()); n != sessions {
		t.Fatalf("%d sessions placed by refused requests", n-sessions)
	}
	// Still serving: a valid top-p session runs to its end.
	n := 0
	_, err := w.front.RunSession(context.Background(), w.front.Controller(w.url("/pc/")), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat,
		Tokens: []uint32{1, 2, 3}, MaxTokens: 4, Sampler: &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 1.0}, Seed: 1}},
		50*time.Millisecond, func(uint64, uint32) error { n++; return nil })
	if err != nil || n != 4 {
		t.Fatalf("a valid request after the bad ones: %d tokens, %v", n, err)
	}
}

// rawBody POSTs a JSON body as it is written with the identity id.
func (w *rig) rawBody(t *testing.T, id, url, body string) (int, []byte) {
	t.Helper()
	hc := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: w.tls(id), ForceAttemptHTTP2: true})
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", kvsp.MediaType)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s: %v (a reset stream?)", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}
