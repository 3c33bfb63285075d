package placement_test

import (
	"context"
	"errors"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	iiID   = "spiffe://kvsp.test/ii"
	h1Base = "https://h1.example/kvsp/"
	bt     = 16 // tokens per block
)

var compat = kvsp.CompatID{0xc0}

// mockII is an inference instance's directive endpoints (the instance
// agent is the next step of this issue): it records what the PC sends.
type mockII struct {
	mu         sync.Mutex
	directives []kvsp.PrefetchDirective
	states     []kvsp.InstanceState
	resumes    []kvsp.ResumeRequest
	gate       func() // when set, called before a resume is accepted
}

func (m *mockII) sent() []kvsp.PrefetchDirective {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]kvsp.PrefetchDirective(nil), m.directives...)
}

func (m *mockII) resumed() []kvsp.ResumeRequest {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]kvsp.ResumeRequest(nil), m.resumes...)
}

func (m *mockII) mount(r *server.Router) {
	r.Handle("POST", "prefetch", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, r *http.Request) error {
		var d kvsp.PrefetchDirective
		if err := server.DecodeJSON(r, &d); err != nil {
			return err
		}
		m.mu.Lock()
		m.directives = append(m.directives, d)
		m.mu.Unlock()
		w.Header().Set("Location", "prefetch/"+d.Directive.String())
		w.WriteHeader(http.StatusAccepted)
		return nil
	})
	r.Handle("POST", "sessions/{session}/resume", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, r *http.Request) error {
		var q kvsp.ResumeRequest
		if err := server.DecodeJSON(r, &q); err != nil {
			return err
		}
		m.mu.Lock()
		gate := m.gate
		m.mu.Unlock()
		if gate != nil {
			gate()
		}
		m.mu.Lock()
		m.resumes = append(m.resumes, q)
		m.mu.Unlock()
		w.WriteHeader(http.StatusAccepted)
		return nil
	})
	r.Handle("PUT", "state", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, r *http.Request) error {
		var b kvsp.StateBody
		if err := server.DecodeJSON(r, &b); err != nil {
			return err
		}
		m.mu.Lock()
		m.states = append(m.states, b.State)
		m.mu.Unlock()
		return server.WriteJSON(w, http.StatusOK, &b)
	})
}

type world struct {
	srv      *kvsptest.Server
	pc       *placement.Controller
	mem      *index.Memory
	ii       map[string]*mockII // by base URI
	base     map[string]string  // name -> base URI
	ctl      *client.Controller // with the instances' identity
	front    *client.Client     // a front end (client role)
	scopeKey kvsp.ScopeKey
	pki      *kvsptest.PKI

	mu      sync.Mutex
	granted map[string][]kvsp.GrantID // placements per instance, reported started by its next status
}

// track notes a place answer's placement, which the next status of its
// instance reports started, as an instance would once its generate
// arrived: the room it held is then in the instance's own counts.
func (w *world) track(t *testing.T, out *kvsp.PlaceResponse, key kvsp.ScopeKey) {
	t.Helper()
	g, err := kvsp.OpenGrant(key, out.Grant)
	if err != nil {
		t.Fatalf("the place answer's grant: %v", err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.granted == nil {
		w.granted = map[string][]kvsp.GrantID{}
	}
	w.granted[g.Instance] = append(w.granted[g.Instance], g.ID)
}

// started takes the placements tracked at an instance.
func (w *world) started(base string) []kvsp.GrantID {
	w.mu.Lock()
	defer w.mu.Unlock()
	ids := w.granted[base]
	delete(w.granted, base)
	return ids
}

func newWorld(t *testing.T, maxPending int) *world { return newWorldWith(t, maxPending, nil) }

// newWorldWith is newWorld with the PC's configuration changed by edit.
func newWorldWith(t *testing.T, maxPending int, edit func(*placement.Config)) *world {
	w := &world{ii: map[string]*mockII{}, base: map[string]string{}}
	p := kvsptest.NewPKI(t)
	w.pki = p
	w.mem = index.NewMemory(time.Second)
	t.Cleanup(func() { w.mem.Close() })
	svc, _ := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096}, w.mem)
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i) // the appendix scope key: kvsptest.Scope
	}
	w.scopeKey, _ = kvsp.NewScopeKey(key)
	pcc, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(kvsptest.PC))})
	t.Cleanup(pcc.Close)
	mocks := map[string]*mockII{"ii1": {}, "ii2": {}, "ii3": {}}
	w.srv = kvsptest.StartServer(t, p, kvsptest.Options{}, func(s *server.Server) {
		svc.Mount(s.Mount("/is/"))
		for name, m := range mocks {
			m.mount(s.Mount("/" + name + "/"))
		}
	})
	var err error
	cfg := placement.Config{Scopes: []kvsp.ScopeKey{w.scopeKey}, BlockTokens: map[kvsp.CompatID]int{compat: bt},
		Index: pcc.Index(w.srv.URL("/is/")), Instances: placement.ClientInstances{C: pcc}, MaxPending: maxPending}
	if edit != nil {
		edit(&cfg)
	}
	w.pc, err = placement.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w.pc.Mount(w.srv.Server.Mount("/pc/"))
	// The instances' identity speaks for their bases, which carry the
	// server's port: the policy is rewritten now that it is known.
	var speaks []string
	for name, m := range mocks {
		u := w.srv.URL("/" + name + "/")
		w.ii[u], w.base[name] = m, u
		speaks = append(speaks, `"`+u+`"`)
	}
	pol := kvsptest.Policy + `  - {id: "` + iiID + `", roles: [instance], speaks_for: [` + strings.Join(speaks, ", ") + `], scopes: [` + kvsptest.Scope + `]}
`
	if err := os.WriteFile(p.Path("policy.yaml"), []byte(pol), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := w.srv.Policy.Reload(); err != nil {
		t.Fatal(err)
	}
	ic, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(iiID))})
	t.Cleanup(ic.Close)
	w.ctl = ic.Controller(w.srv.URL("/pc/"))
	w.front, _ = client.New(client.Config{TLS: p.ClientTLS(p.Leaf(kvsptest.ClientA))})
	t.Cleanup(w.front.Close)
	return w
}

func (w *world) status(t *testing.T, name string, epoch, queued uint64, state kvsp.InstanceState, links ...kvsp.Link) kvsp.InstanceState {
	return w.statusTTL(t, name, epoch, queued, state, 60000, links...)
}

func (w *world) statusTTL(t *testing.T, name string, epoch, queued uint64, state kvsp.InstanceState, ttlMs uint64, links ...kvsp.Link) kvsp.InstanceState {
	t.Helper()
	st := &kvsp.InstanceStatus{Instance: w.base[name], Epoch: epoch, State: state, Queued: queued, BatchSize: 8,
		PrefillTokensPerS: 42000, DecodeTokensPerS: 3100, Links: append([]kvsp.Link{}, links...), TTLMs: ttlMs, CompatID: compat,
		Started: w.started(w.base[name])}
	got, err := w.ctl.PutStatus(context.Background(), st)
	if err != nil {
		t.Fatalf("status of %s: %v", name, err)
	}
	return got.State
}

// publish puts replicas at h1 for the first n blocks of tokens.
func (w *world) publish(t *testing.T, tokens []uint32, n int) {
	keys, _ := kvsp.BlockKeys(w.scopeKey, compat, bt, tokens)
	for _, k := range keys[:n] {
		r := &kvsp.ReplicaRecord{BlockKey: k, CompatID: compat, ScopeID: w.scopeKey.ID(), Holder: h1Base, Codec: 1, Size: 2097152,
			Digest: kvsp.Digest{1}, LayerDigests: []kvsp.LayerDigest{{1}}, TTLMs: 60000,
			Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 0}}}}
		if _, err := w.mem.Put(context.Background(), r, time.Minute, index.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// checkpoint is the checkpoint of a session of prompt tokens at output
// offset gen (greedy), its prompt the session's.
func (w *world) checkpoint(session kvsp.UUID, epoch uint64, tokens []uint32, gen uint64) *kvsp.Checkpoint {
	keys, _ := kvsp.BlockKeys(w.scopeKey, compat, bt, tokens)
	return &kvsp.Checkpoint{Session: session, Epoch: epoch, CompatID: compat, ScopeID: w.scopeKey.ID(), PromptBlocks: keys,
		PromptTail: append([]uint32{}, tokens[len(keys)*bt:]...), Generated: make([]uint32, gen), OutputOffset: gen,
		Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Step: gen, Deterministic: true}}
}

func (w *world) place(t *testing.T, tokens []uint32) (*kvsp.PlaceResponse, error) {
	t.Helper()
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16}
	out, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q)
	if err == nil {
		w.track(t, out, w.scopeKey)
	}
	return out, err
}

func prompt(n int, seed uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100000 + uint32(i)
	}
	return out
}

// TestDirectiveDeadlineBounds: a directive's deadline_ms is the longer of
// twice the estimated fetch and the matched prefix's recomputation, held
// between MinDeadline (10 ms unless configured) and MaxDeadline. On a fast
// link with an instance that recomputes quickly, the floor decides.
func TestDirectiveDeadlineBounds(t *testing.T) {
	for _, c := range []struct {
		name string
		min  time.Duration
		want uint64
	}{{"default floor", 0, 10}, {"configured floor", 750 * time.Millisecond, 750}, {"floor above the cap", 5 * time.Second, 2000}} {
		t.Run(c.name, func(t *testing.T) {
			w := newWorldWith(t, 4, func(cfg *placement.Config) { cfg.MinDeadline = c.min })
			tokens := prompt(2*bt, 3)
			w.publish(t, tokens, 2)
			w.status(t, "ii2", 1, 0, kvsp.StateActive, kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12})
			out, err := w.place(t, tokens)
			if err != nil || out.Directive == nil {
				t.Fatalf("placed %+v, %v; want a directive", out, err)
			}
			if d := w.ii[w.base["ii2"]].directives[0]; d.DeadlineMs != c.want {
				t.Fatalf("deadline_ms %d, want %d", d.DeadlineMs, c.want)
			}
		})
	}
}

// TestPlaceByCost: R-PLC-9 (the instance with the cached prefix and a
// link to its holder wins over one without), R-PF-1 (the directive names
// the matched blocks and their sources, request_ref the session), R-ST-12
// (a draining instance gets nothing), 409 for an unserved model, 403
// before any lookup for a scope the caller lacks.
func TestPlaceByCost(t *testing.T) {
	w := newWorld(t, 4)
	tokens := prompt(10*bt+5, 1)
	if _, err := w.place(t, tokens); !errors.Is(err, kvsp.ErrIncompatible) {
		t.Fatalf("no instance: %v, want 409 kvsp-incompatible", err)
	}
	w.publish(t, tokens, 8)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 0, kvsp.StateActive) // no link to h1: must recompute
	w.status(t, "ii2", 1, 0, kvsp.StateActive, link)
	w.status(t, "ii3", 1, 0, kvsp.StateDraining, link)
	out, err := w.place(t, tokens)
	if err != nil {
		t.Fatal(err)
	}
	if out.Instance != w.base["ii2"] || out.Matched != 8 || out.Epoch != 1 || out.Directive == nil || out.Session.IsZero() {
		t.Fatalf("placed %+v", out)
	}
	m := w.ii[w.base["ii2"]]
	if len(m.directives) != 1 {
		t.Fatalf("%d directives at ii2", len(m.directives))
	}
	d := m.directives[0]
	keys, _ := kvsp.BlockKeys(w.scopeKey, compat, bt, tokens)
	if d.Directive != *out.Directive || d.RequestRef != out.Session.String() || len(d.Blocks) != 8 || d.Blocks[7].BlockKey != keys[7] ||
		len(d.Blocks[0].Sources) != 1 || d.Blocks[0].Sources[0] != h1Base || d.DeadlineMs == 0 || d.LayerOrder != "ascending" {
		t.Fatalf("directive %+v", d)
	}
	if s, ok := w.pc.Session(w.scopeKey.ID(), out.Session); !ok || s.Instance != w.base["ii2"] || s.Epoch != 1 {
		t.Fatalf("session %+v", s)
	}
	if n := len(w.ii[w.base["ii3"]].directives); n != 0 {
		t.Fatalf("a draining instance got %d directives (R-ST-12)", n)
	}
	// A prompt with nothing cached: no directive, still placed.
	if out, err := w.place(t, prompt(40, 2)); err != nil || out.Directive != nil || out.Matched != 0 {
		t.Fatalf("uncached prompt: %+v %v", out, err)
	}
	// A caller without the scope: 403 before any lookup.
	p := w.srv.PKI
	other, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(kvsptest.DNSOnly))})
	defer other.Close()
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 1}
	if _, err := other.Controller(w.srv.URL("/pc/")).Place(context.Background(), q); !errors.Is(err, kvsp.ErrScopeDenied) {
		t.Fatalf("caller without the scope: %v", err)
	}
}

// TestPlaceSpreadsBetweenStatusRecords: R-PLC-7: requests placed before
// the instances' next status record are counted as their load: equally
// good idle instances get one each, not all the first; once the batches
// overflow, the queue the PC placed there weighs like a reported one.
func TestPlaceSpreadsBetweenStatusRecords(t *testing.T) {
	w := newWorld(t, 4)
	for _, ii := range []string{"ii1", "ii2", "ii3"} {
		w.status(t, ii, 1, 0, kvsp.StateActive)
	}
	got := map[string]int{}
	for i := range 9 {
		out, err := w.place(t, prompt(2*bt, uint32(20+i)))
		if err != nil {
			t.Fatal(err)
		}
		got[out.Instance]++
	}
	for _, ii := range []string{"ii1", "ii2", "ii3"} {
		if got[w.base[ii]] != 3 {
			t.Fatalf("placements %v: want 3 each", got)
		}
	}
	// A status record resets the count: ii1 reports itself idle, the
	// others still carry three placed each.
	w.status(t, "ii1", 1, 0, kvsp.StateActive)
	if out, err := w.place(t, prompt(2*bt, 40)); err != nil || out.Instance != w.base["ii1"] {
		t.Fatalf("after ii1's status: %+v %v", out, err)
	}
}

// TestPlaceWakesSleeping: R-PLC-10/11: when no active instance has
// capacity, a sleeping one is set active and sent its prefetch at once;
// with none to wake, 503 with Retry-After.
func TestPlaceWakesSleeping(t *testing.T) {
	w := newWorld(t, 4)
	tokens := prompt(4*bt, 3)
	w.publish(t, tokens, 4)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 8, kvsp.StateActive, link) // queue full (batch 8)
	w.status(t, "ii2", 1, 0, kvsp.StateSleeping, link)
	out, err := w.place(t, tokens)
	if err != nil || out.Instance != w.base["ii2"] || out.Directive == nil {
		t.Fatalf("placed %+v %v", out, err)
	}
	m := w.ii[w.base["ii2"]]
	if len(m.states) != 1 || m.states[0] != kvsp.StateActive || len(m.directives) != 1 {
		t.Fatalf("woken: states %v, %d directives", m.states, len(m.directives))
	}
	w.status(t, "ii2", 1, 8, kvsp.StateActive, link) // now full too
	_, err = w.place(t, tokens)
	if !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("no capacity: %v, want 503", err)
	}
	var p *kvsp.Problem
	if !errors.As(err, &p) {
		t.Fatalf("not a problem: %v", err)
	}
}

// TestPlaceWaitsForCapacity: a request that finds every instance full
// waits at the PC (CapacityWait) and is placed when a status record shows
// room, instead of a 503 the front end answers by sending the whole
// prompt again; past the wait it is refused (503, Retry-After), counted
// once.
func TestPlaceWaitsForCapacity(t *testing.T) {
	w := newWorldWith(t, 0, func(c *placement.Config) { c.CapacityWait = 20 * time.Second })
	tokens := prompt(2*bt, 4)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 8, kvsp.StateActive, link) // queue full (batch 8)
	type result struct {
		out *kvsp.PlaceResponse
		err error
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() { out, err := w.place(t, tokens); done <- result{out, err} }()
	select {
	case r := <-done:
		t.Fatalf("placed with every instance full: %+v %v", r.out, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	w.status(t, "ii1", 1, 0, kvsp.StateActive, link) // room again
	select {
	case r := <-done:
		if r.err != nil || r.out.Instance != w.base["ii1"] {
			t.Fatalf("after room: %+v %v", r.out, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("still waiting %v after a status record with room", time.Since(start))
	}

	w2 := newWorldWith(t, 0, func(c *placement.Config) { c.CapacityWait = 200 * time.Millisecond })
	w2.status(t, "ii1", 1, 8, kvsp.StateActive, link)
	if _, err := w2.place(t, tokens); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("past the wait: %v, want 503", err)
	}
}

// TestPlaceCountsWhatItPlaced (R-PLC-7): between two status records an
// instance takes what its batch and a batch of queue hold, counting the
// requests placed on it since its last record; a burst does not pile onto
// it, and the next record (its queue drained) makes room again.
func TestPlaceCountsWhatItPlaced(t *testing.T) {
	w := newWorldWith(t, 0, func(c *placement.Config) { c.CapacityWait = -1; c.MaxShare = 1 })
	tokens := prompt(2*bt, 4)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 0, kvsp.StateActive, link) // idle, batch 8
	for i := range 16 {                              // 8 running and 8 queued, as the PC counts them
		if out, err := w.place(t, tokens); err != nil || out.Instance != w.base["ii1"] {
			t.Fatalf("request %d: %+v %v", i, out, err)
		}
	}
	if out, err := w.place(t, tokens); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("the 17th request with no status record since: %+v %v, want 503 (a batch queued already)", out, err)
	}
	w.status(t, "ii1", 1, 0, kvsp.StateActive, link)
	if _, err := w.place(t, tokens); err != nil {
		t.Fatalf("after a record with room: %v", err)
	}
}

// TestPlaceConcurrentBurstTakesTheRoomOnce (R-PLC-7): requests placed at
// once (those one status record wakes, each having seen the same room)
// take an instance's room once between them: the room is reserved when
// an instance is chosen, not counted after the request was placed.
// Counting after (the race this closes) placed every one of the 64 here,
// four times the batch and its queue, and under load queued twice a batch
// at each instance, where the blocks loaded for the waiting requests were
// evicted before their prefill.
func TestPlaceConcurrentBurstTakesTheRoomOnce(t *testing.T) {
	w := newWorldWith(t, 0, func(c *placement.Config) { c.CapacityWait = -1; c.MaxShare = 1 })
	tokens := prompt(2*bt, 4)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	w.status(t, "ii1", 1, 0, kvsp.StateActive, link) // idle, batch 8: room for 16
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16}
	// One first, so that the others' lookups share the PC's connection to
	// the IS (concurrent first dials leave one the test server's shutdown
	// waits for).
	if _, err := w.pc.Place(context.Background(), q); err != nil {
		t.Fatal(err)
	}
	placed, refused := atomic.Int64{}, atomic.Int64{}
	placed.Add(1)
	var wg sync.WaitGroup
	for range 63 {
		wg.Go(func() {
			_, err := w.pc.Place(context.Background(), q)
			switch {
			case err == nil:
				placed.Add(1)
			case errors.Is(err, kvsp.ErrUnavailable):
				refused.Add(1)
			default:
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if placed.Load() != 16 || refused.Load() != 48 {
		t.Fatalf("64 requests at once on room for 16: %d placed, %d refused", placed.Load(), refused.Load())
	}
}

// TestPlacePendingQuota: R-PF-13: beyond MaxPending directives pending at
// an instance, requests are still placed but without a directive.
func TestPlacePendingQuota(t *testing.T) {
	w := newWorld(t, 1)
	link := kvsp.Link{Holder: h1Base, MbitPerS: 200000, RTTUs: 12}
	// A slow prefill makes the directive's deadline (the recomputation of
	// the matched prefix) the 2 s cap: its slot is still taken when the
	// second request comes, however loaded the machine.
	st := &kvsp.InstanceStatus{Instance: w.base["ii1"], Epoch: 1, State: kvsp.StateActive, BatchSize: 8, PrefillTokensPerS: 10,
		DecodeTokensPerS: 3100, Links: []kvsp.Link{link}, TTLMs: 60000, CompatID: compat}
	if _, err := w.ctl.PutStatus(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	a, b := prompt(4*bt, 4), prompt(4*bt, 5)
	w.publish(t, a, 4)
	w.publish(t, b, 4)
	if out, err := w.place(t, a); err != nil || out.Directive == nil {
		t.Fatalf("first: %+v %v", out, err)
	}
	if out, err := w.place(t, b); err != nil || out.Directive != nil || out.Instance != w.base["ii1"] {
		t.Fatalf("second, over the quota: %+v %v", out, err)
	}
}

// TestStatusOverHTTP: R-ST-2 (path id = b64url(SHA-256(instance))),
// R-ST-6 / A-12 over the wire (409 kvsp-stale-epoch with the epoch), and
// speaks_for (another instance's record is 403).
func TestStatusOverHTTP(t *testing.T) {
	w := newWorld(t, 4)
	if s := w.status(t, "ii1", 12, 0, kvsp.StateActive); s != kvsp.StateActive {
		t.Fatalf("state %s", s)
	}
	st := &kvsp.InstanceStatus{Instance: w.base["ii1"], Epoch: 11, State: kvsp.StateDraining, BatchSize: 8, PrefillTokensPerS: 1,
		Links: []kvsp.Link{}, TTLMs: 3000, CompatID: compat}
	_, err := w.ctl.PutStatus(context.Background(), st)
	var p *kvsp.Problem
	if !errors.Is(err, kvsp.ErrStaleEpoch) || !errors.As(err, &p) || p.Extensions["epoch"] != float64(12) {
		t.Fatalf("stale epoch: %v", err)
	}
	st.Instance, st.Epoch = "https://elsewhere.example/kvsp/", 1
	if _, err := w.ctl.PutStatus(context.Background(), st); !errors.Is(err, kvsp.ErrForbidden) {
		t.Fatalf("a record for a base it does not speak for: %v", err)
	}
}

// TestCheckpointOverHTTP: the instance serving a placed session PUTs its
// checkpoints and gets the recorded offset back (R-SES-3, A-24); an
// unknown session is 404 (R-SES-17).
func TestCheckpointOverHTTP(t *testing.T) {
	w := newWorld(t, 4)
	w.status(t, "ii1", 1, 0, kvsp.StateActive)
	tokens := prompt(40, 7)
	out, err := w.place(t, tokens)
	if err != nil {
		t.Fatal(err)
	}
	cp := w.checkpoint(out.Session, out.Epoch, tokens, 16)
	ack, err := w.ctl.PutCheckpoint(context.Background(), cp)
	if err != nil || ack.OutputOffset != 16 {
		t.Fatalf("checkpoint: %+v %v", ack, err)
	}
	cp.Session = kvsp.NewUUID()
	if _, err := w.ctl.PutCheckpoint(context.Background(), cp); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("unknown session: %v", err)
	}
}

// TestMigration: R-SES-10/15, A-23: when a session's instance fails (its
// status expires), the PC raises the session's epoch, picks another
// instance and sends it POST resume with the latest checkpoint and the new
// epoch, either when the front end asks where the session continues or
// by itself (Run); the failed instance's checkpoints are refused.
func TestMigration(t *testing.T) {
	w := newWorld(t, 4)
	w.statusTTL(t, "ii1", 1, 0, kvsp.StateActive, 300)
	w.status(t, "ii2", 1, 3, kvsp.StateActive) // busier: ii1 is chosen first
	tokens := prompt(3*bt+5, 9)
	var sessions []*kvsp.PlaceResponse
	for i := 0; i < 2; i++ {
		out, err := w.place(t, tokens)
		if err != nil || out.Instance != w.base["ii1"] {
			t.Fatalf("place: %+v %v", out, err)
		}
		sessions = append(sessions, out)
		cp := w.checkpoint(out.Session, 1, tokens, 8)
		if _, err := w.ctl.PutCheckpoint(context.Background(), cp); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(350 * time.Millisecond) // ii1's status expires: failed
	// The front end asks where session 0 continues.
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16, Session: &sessions[0].Session}
	out, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q)
	if err != nil || out.Instance != w.base["ii2"] || out.Epoch != 2 || out.Session != sessions[0].Session {
		t.Fatalf("continue: %+v %v", out, err)
	}
	rs := w.ii[w.base["ii2"]].resumed()
	if len(rs) != 1 || rs[0].Epoch != 2 || rs[0].Checkpoint.OutputOffset != 8 || rs[0].Checkpoint.Session != sessions[0].Session {
		t.Fatalf("resumes at ii2: %+v", rs)
	}
	// The failed instance's late checkpoint carries the old epoch.
	late := rs[0].Checkpoint
	late.Generated, late.OutputOffset, late.Sampler.Step = make([]uint32, 9), 9, 9
	if _, err := w.ctl.PutCheckpoint(context.Background(), &late); !errors.Is(err, kvsp.ErrStaleEpoch) {
		t.Fatalf("the old epoch's checkpoint: %v", err)
	}
	// Session 1 is migrated by the PC itself.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.pc.Run(ctx, 20*time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(5 * time.Second)
	for len(w.ii[w.base["ii2"]].resumed()) < 2 {
		if time.Now().After(deadline) {
			t.Fatal("session 1 was not migrated")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s, _ := w.pc.Session(w.scopeKey.ID(), sessions[1].Session); s.Epoch != 2 || s.Instance != w.base["ii2"] {
		t.Fatalf("session 1: %+v", s)
	}
}

// TestRestartedInstanceLosesItsSessions: an instance that reports a higher
// epoch restarted (R-ST-5): the sessions placed on its previous
// incarnation are gone with it, so the PC migrates them (the epoch goes
// up, POST resume with the checkpoint), here back to the same instance,
// the cheapest; its sessions placed after the restart stay.
func TestRestartedInstanceLosesItsSessions(t *testing.T) {
	w := newWorld(t, 4)
	w.status(t, "ii1", 1, 0, kvsp.StateActive)
	w.status(t, "ii2", 1, 3, kvsp.StateActive) // busier: ii1 is chosen
	tokens := prompt(3*bt+5, 11)
	out, err := w.place(t, tokens)
	if err != nil || out.Instance != w.base["ii1"] {
		t.Fatalf("place: %+v %v", out, err)
	}
	cp := w.checkpoint(out.Session, 1, tokens, 8)
	if _, err := w.ctl.PutCheckpoint(context.Background(), cp); err != nil {
		t.Fatal(err)
	}
	w.status(t, "ii1", 2, 0, kvsp.StateActive) // restarted, and alive
	q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16, Session: &out.Session}
	got, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q)
	if err != nil || got.Instance != w.base["ii1"] || got.Epoch != 2 {
		t.Fatalf("continue after the restart: %+v %v", got, err)
	}
	if rs := w.ii[w.base["ii1"]].resumed(); len(rs) != 1 || rs[0].Epoch != 2 || rs[0].Checkpoint.OutputOffset != 8 {
		t.Fatalf("resumes at the restarted ii1: %+v", rs)
	}
	// Asked again: it stays (placed on the current incarnation).
	if again, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q); err != nil || again.Epoch != 2 {
		t.Fatalf("continue again: %+v %v", again, err)
	}
}

// TestPlaceCountsARecomputedPrefix: a request whose cached prefix the
// chosen instance cannot load (no link to its holder) is placed without a
// directive, and the decision is counted (kvsp_pc_directives_total
// outcome="recompute"), so that sharing lost to it shows; a prompt with
// nothing cached is not counted.
func TestPlaceCountsARecomputedPrefix(t *testing.T) {
	reg := prometheus.NewRegistry()
	w := newWorldWith(t, 4, func(c *placement.Config) { c.Registerer = reg })
	tokens := prompt(10*bt+5, 1)
	w.publish(t, tokens, 8)
	w.status(t, "ii1", 1, 0, kvsp.StateActive) // no link to h1
	recomputed := func() float64 {
		return kvsptest.MetricSum(t, reg, "kvsp_pc_directives_total", map[string]string{"outcome": "recompute"})
	}
	if out, err := w.place(t, prompt(40, 2)); err != nil || out.Matched != 0 || recomputed() != 0 {
		t.Fatalf("uncached prompt: %+v %v, counted %v", out, err, recomputed())
	}
	out, err := w.place(t, tokens)
	if err != nil || out.Matched != 8 || out.Directive != nil {
		t.Fatalf("placed %+v %v: want 8 matched, no directive", out, err)
	}
	if n := recomputed(); n != 1 {
		t.Fatalf("recomputed prefixes counted %v, want 1", n)
	}
}

// TestConcurrentMigrationsAnswerAResumedEpoch (RELIABILITY F14; R-SES-10,
// R-SES-15): two front ends ask where a session of a failed instance
// continues, at once, and both migrations have chosen ii2 (failpoint
// pc/migration-chosen pauses them there). One raises the epoch and sends
// the resume, which ii2 is slow to accept; the other finds the session
// moved. Neither answer may name epoch 2 before ii2 has accepted a resume
// at it: a front end told epoch 2 too early asked ii2, was answered 404,
// and was then told the same instance and epoch at every later place,
// and its session stopped (TestChaosSessionsSurviveRandomKills, 1 run in
// about 50). Mutation: answering the session moved meanwhile at once (as
// before) fails this.
func TestConcurrentMigrationsAnswerAResumedEpoch(t *testing.T) {
	t.Cleanup(failpoint.Reset)
	w := newWorld(t, 4)
	w.statusTTL(t, "ii1", 1, 0, kvsp.StateActive, 300)
	w.status(t, "ii2", 1, 3, kvsp.StateActive)
	tokens := prompt(3*bt+5, 12)
	out, err := w.place(t, tokens)
	if err != nil || out.Instance != w.base["ii1"] {
		t.Fatalf("place: %+v %v", out, err)
	}
	if _, err := w.ctl.PutCheckpoint(context.Background(), w.checkpoint(out.Session, 1, tokens, 8)); err != nil {
		t.Fatal(err)
	}
	// ii2 holds the first resume it is sent until release is closed.
	ii2 := w.ii[w.base["ii2"]]
	entered, release := make(chan struct{}), make(chan struct{})
	var first atomic.Bool
	ii2.mu.Lock()
	ii2.gate = func() {
		if first.CompareAndSwap(false, true) {
			close(entered)
			<-release
		}
	}
	ii2.mu.Unlock()
	time.Sleep(350 * time.Millisecond) // ii1's status expires: failed
	if err := failpoint.Enable("pc/migration-chosen", "pause"); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		out     *kvsp.PlaceResponse
		err     error
		resumed []kvsp.ResumeRequest // what ii2 had accepted when the answer came
	}
	answers := make(chan answer, 2)
	for range 2 {
		go func() {
			q := &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 16, Session: &out.Session}
			got, err := w.front.Controller(w.srv.URL("/pc/")).Place(context.Background(), q)
			answers <- answer{got, err, ii2.resumed()}
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for failpoint.Hits("pc/migration-chosen") < 2 {
		if time.Now().After(deadline) {
			t.Fatal("the two migrations did not both choose")
		}
		time.Sleep(5 * time.Millisecond)
	}
	failpoint.Disable("pc/migration-chosen")
	<-entered // one resume is at ii2, not accepted yet
	var a answer
	select {
	case a = <-answers:
	case <-time.After(10 * time.Second):
		close(release)
		t.Fatal("no place answered while the first resume was held")
	}
	close(release)
	b := <-answers
	for _, x := range []answer{a, b} {
		if x.err != nil || x.out.Epoch != 2 || x.out.Instance != w.base["ii2"] {
			t.Fatalf("continue: %+v %v", x.out, x.err)
		}
	}
	if len(a.resumed) == 0 || a.resumed[0].Epoch != 2 {
		t.Fatalf("a place answered epoch 2 on ii2 when ii2 had accepted %d resumes: the front end would be told 404 there", len(a.resumed))
	}
}
