package instance_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/instance"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// group is a parallel group for resharding on one loopback server: an IS,
// a PC, a holder h1 where the context's blocks were first stored, and three
// instances ii1..ii3 on simulated engines, each with its own holder
// (ha, hb, hc). /stuck/ is an instance that never acknowledges a plan.
type group struct {
	srv    *kvsptest.Server
	pc     *placement.Controller
	agents map[string]*instance.Agent // by base URI
	engs   map[string]*sim.Engine
	url    func(string) string
	scope  kvsp.ScopeKey
	compat kvsp.CompatID
	g      container.Geometry
	asPC   *client.Client // the controller's identity
	front  *client.Client // a client with the scope
	stuck  *stuckInstance
	flaky  *flakyInstance
	// pcConfig is the PC's configuration, to start another on the same
	// state (F12's crash).
	pcConfig placement.Config
}

// stuckInstance answers plans only when the caller gives up, and counts
// the aborts it receives.
type stuckInstance struct {
	mu     sync.Mutex
	aborts []uint64
}

func (s *stuckInstance) mount(r *server.Router) {
	r.Handle("POST", "reshard", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, r *http.Request) error {
		var q kvsp.Reshard
		if err := server.DecodeJSON(r, &q); err != nil {
			return err
		}
		switch q.Kind {
		case kvsp.ReshardPlan:
			<-r.Context().Done()
			return r.Context().Err()
		case kvsp.ReshardAbort:
			s.mu.Lock()
			s.aborts = append(s.aborts, q.Abort)
			s.mu.Unlock()
		}
		return server.WriteJSON(w, http.StatusOK, &kvsp.ReshardAck{Map: q.Map})
	})
}

// flakyInstance is ii3 behind a link that loses its first commits.
type flakyInstance struct {
	mu      sync.Mutex
	agent   *instance.Agent
	dropped int
}

func (f *flakyInstance) mount(r *server.Router) {
	r.Handle("POST", "reshard", server.Route{Roles: []server.Role{server.RoleController}}, func(w http.ResponseWriter, r *http.Request) error {
		var q kvsp.Reshard
		if err := server.DecodeJSON(r, &q); err != nil {
			return err
		}
		f.mu.Lock()
		lose := q.Kind == kvsp.ReshardCommit && f.dropped < 4
		if lose {
			f.dropped++
		}
		f.mu.Unlock()
		if lose {
			return fmt.Errorf("%w: the commit was lost", kvsp.ErrUnavailable)
		}
		ack, err := f.agent.Reshard(r.Context(), &q)
		if err != nil {
			return err
		}
		return server.WriteJSON(w, http.StatusOK, ack)
	})
}

func newGroup(t *testing.T) *group { return newGroupWith(t, nil) }

// newGroupWith is newGroup with the PC's state in store.
func newGroupWith(t *testing.T, store placement.Store) *group {
	w := &group{agents: map[string]*instance.Agent{}, engs: map[string]*sim.Engine{}, stuck: &stuckInstance{}, flaky: &flakyInstance{}}
	p := kvsptest.NewPKI(t)
	mem := index.NewMemory(time.Second)
	t.Cleanup(func() { mem.Close() })
	svc, _ := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096}, mem)
	w.srv = kvsptest.StartServer(t, p, kvsptest.Options{}, func(s *server.Server) {
		svc.Mount(s.Mount("/is/"))
		w.stuck.mount(s.Mount("/stuck/"))
		w.flaky.mount(s.Mount("/flaky/"))
	})
	w.url = w.srv.URL
	u := w.url
	pol := `principals:
  - {id: "` + kvsptest.PC + `", roles: [controller], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + kvsptest.Holder1 + `", roles: [holder], speaks_for: ["` + u("/h1/") + `", "` + u("/ha/") + `", "` + u("/hb/") + `", "` + u("/hc/") + `"], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + kvsptest.ClientA + `", roles: [client, producer], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + agentID + `", roles: [instance, client], speaks_for: ["` + u("/ii1/") + `", "` + u("/ii2/") + `", "` + u("/ii3/") + `", "` + u("/stuck/") + `", "` + u("/flaky/") + `"], scopes: [` + kvsptest.Scope + `]}
`
	os.WriteFile(p.Path("policy.yaml"), []byte(pol), 0o644)
	if err := w.srv.Policy.Reload(); err != nil {
		t.Fatal(err)
	}
	mk := func(id string) *client.Client {
		c, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(id)), Attempts: 1})
		t.Cleanup(c.Close)
		return c
	}
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i)
	}
	w.scope, _ = kvsp.NewScopeKey(key)
	w.compat, _ = desc.CompatID()
	hc := mk(kvsptest.Holder1)
	for _, base := range []string{"/h1/", "/ha/", "/hb/", "/hc/"} {
		h, err := holder.New(holder.Config{Base: u(base), Geometries: map[kvsp.CompatID]container.Geometry{w.compat: mustGeometry(t)}, Capacity: 64 << 20,
			ReadMbitPerS: 100000, Index: hc.Index(u("/is/")), RecordTTL: time.Minute,
			LeaseQuota: holder.LeaseQuota{Octets: 64 << 20, MaxTTL: time.Minute, MaxLeases: 256}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close(context.Background()) })
		h.Mount(w.srv.Server.Mount(base))
	}
	w.asPC = mk(kvsptest.PC)
	w.front = mk(kvsptest.ClientA)
	w.pcConfig = placement.Config{Scopes: []kvsp.ScopeKey{w.scope}, BlockTokens: map[kvsp.CompatID]int{w.compat: 16},
		Index: w.asPC.Index(u("/is/")), Instances: placement.ClientInstances{C: w.asPC}, State: store}
	w.pc, _ = placement.New(w.pcConfig)
	w.pc.Mount(w.srv.Server.Mount("/pc/"))
	ac := mk(agentID)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for i, name := range []string{"ii1", "ii2", "ii3"} {
		eng, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000, BatchSize: 4, KVBlocks: 64})
		a, err := instance.New(instance.Config{Base: u("/" + name + "/"), Engine: eng, Client: ac, Index: u("/is/"), Holder: u("/h" + string(rune('a'+i)) + "/"),
			Controller: u("/pc/"), StatusTTL: 300 * time.Millisecond, Scopes: []kvsp.ScopeKey{w.scope}})
		if err != nil {
			t.Fatal(err)
		}
		a.Mount(w.srv.Server.Mount("/" + name + "/"))
		if name == "ii3" {
			w.flaky.agent = a
		}
		w.agents[u("/"+name+"/")], w.engs[u("/"+name+"/")] = a, eng
		wg.Go(func() { a.Run(ctx) })
	}
	w.g = mustGeometry(t)
	// The stand-in members report too: the PC sends a scope's plans only
	// to instances whose identity may use the scope (S12).
	for base, holder := range map[string]string{u("/stuck/"): "", u("/flaky/"): u("/hc/")} {
		st := &kvsp.InstanceStatus{Instance: base, Epoch: 1, State: kvsp.StateActive, BatchSize: 1, Links: []kvsp.Link{}, TTLMs: 3_600_000,
			CompatID: w.compat, Holder: holder}
		if _, err := ac.Controller(u("/pc/")).PutStatus(context.Background(), st); err != nil {
			t.Fatal(err)
		}
	}
	for base := range w.agents { // the PC learns each instance's holder from its status
		deadline := time.Now().Add(5 * time.Second)
		for s, ok := w.pc.Registry().Get(base); !ok || s.Status.Holder == ""; s, ok = w.pc.Registry().Get(base) {
			if time.Now().After(deadline) {
				t.Fatalf("the PC does not know %s", base)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return w
}

func mustGeometry(t *testing.T) container.Geometry {
	e, err := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 1, DecodeTokensPerS: 1})
	if err != nil {
		t.Fatal(err)
	}
	return e.Geometry()
}

func (w *group) shardMap(version uint64, shards ...any) kvsp.ShardMap {
	m := kvsp.ShardMap{Map: "c3f8e1", Version: version}
	for i := 0; i < len(shards); i += 3 {
		m.Shards = append(m.Shards, kvsp.Shard{Tokens: kvsp.TokenRange{uint64(shards[i].(int)), uint64(shards[i+1].(int))}, Instance: w.url(shards[i+2].(string))})
	}
	return m
}

// fill stores the first n blocks of tokens at h1 (a prefill elsewhere),
// which publishes them.
func (w *group) fill(t *testing.T, tokens []uint32, n int) {
	rg := &rig{srv: w.srv, compat: w.compat, scopeKey: w.scope, g: w.g, url: w.url, isURL: w.url("/is/"), front: w.asPC, src: w.front.Holder(w.url("/h1/"))} // ClientA stores blocks (the producer role)
	rg.fill(t, tokens, n)
}

func (w *group) ranges(base string) (uint64, []kvsp.TokenRange) {
	return w.agents[w.url(base)].ShardRanges(w.scope.ID(), "c3f8e1")
}

// TestReshardRetainsInPlace: a context of 8 blocks goes from no map to
// {ii1: [0,64), ii2: [64,128)} and then to {ii1: [0,32), ii2: [32,96),
// ii3: [96,128)}. Each member gets its plan (R-RSH-3), ranges that stay
// are retained (R-RSH-5) and cost zero octets (R-RSH-6: the octets moved
// are exactly those of the fetched blocks), fetches come from the old
// owner's holder, and after commit the released blocks leave the engine
// (R-RSH-10).
func TestReshardRetainsInPlace(t *testing.T) {
	w := newGroup(t)
	ctx := context.Background()
	tokens := prompt(8)[:128]
	keys, _ := kvsp.BlockKeys(w.scope, w.compat, 16, tokens)
	// The context's blocks were stored at h1 once (a prefill elsewhere).
	w.fill(t, tokens, 8)
	blockLen := 2 * w.g.RawSectionLen() * uint64(w.g.Layers)

	v1 := w.shardMap(1, 0, 64, "/ii1/", 64, 128, "/ii2/")
	res, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v1, ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: tokens, Deadline: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if res.FetchedBytes[w.url("/ii1/")] != 4*blockLen || res.FetchedBytes[w.url("/ii2/")] != 4*blockLen {
		t.Fatalf("first map: fetched %v, want 4 blocks each", res.FetchedBytes)
	}
	if v, r := w.ranges("/ii1/"); v != 1 || !reflect.DeepEqual(r, []kvsp.TokenRange{{0, 64}}) {
		t.Fatalf("ii1 at v%d holds %v", v, r)
	}

	// The plans of v2, as PlanReshard makes them (checked below), and v2
	// itself through the PC's API (PUT maps/{map}).
	utilBefore := w.engs[w.url("/ii1/")].Stats().KVUtilization
	v2 := w.shardMap(2, 0, 32, "/ii1/", 32, 96, "/ii2/", 96, 128, "/ii3/")
	plans := placement.PlanReshard(v1, v2)
	up, err := w.front.Controller(w.url("/pc/")).UpdateMap(ctx, &kvsp.MapUpdate{Map: v2, ScopeID: w.scope.ID(), CompatID: w.compat, DeadlineMs: 5000})
	if err != nil {
		t.Fatal(err)
	}
	res.FetchedBytes = up.FetchedBytes
	p1, p2, p3 := plans[w.url("/ii1/")], plans[w.url("/ii2/")], plans[w.url("/ii3/")]
	if p1 == nil || p2 == nil || p3 == nil || p3.From != 1 || p3.To != 2 {
		t.Fatalf("plans %v: every member of either version gets one, from 1 to 2", res.Plans)
	}
	if !reflect.DeepEqual(p1.Retain, []kvsp.TokenRange{{0, 32}}) || len(p1.Fetch) != 0 || !reflect.DeepEqual(p1.Release, []kvsp.TokenRange{{32, 64}}) {
		t.Fatalf("ii1's plan %+v", p1)
	}
	if !reflect.DeepEqual(p2.Retain, []kvsp.TokenRange{{64, 96}}) || len(p2.Fetch) != 1 || p2.Fetch[0].Tokens != (kvsp.TokenRange{32, 64}) ||
		p2.Fetch[0].From != w.url("/ii1/") {
		t.Fatalf("ii2's plan %+v", p2)
	}
	if len(p3.Retain) != 0 || len(p3.Fetch) != 1 || p3.Fetch[0].From != w.url("/ii2/") {
		t.Fatalf("ii3's plan %+v", p3)
	}
	// R-RSH-6: the retained ranges moved nothing; the fetched ones exactly
	// their blocks.
	if res.FetchedBytes[w.url("/ii1/")] != 0 || res.FetchedBytes[w.url("/ii2/")] != 2*blockLen || res.FetchedBytes[w.url("/ii3/")] != 2*blockLen {
		t.Fatalf("fetched %v, want 0, 2 and 2 blocks", res.FetchedBytes)
	}
	for base, want := range map[string][]kvsp.TokenRange{"/ii1/": {{0, 32}}, "/ii2/": {{32, 96}}, "/ii3/": {{96, 128}}} {
		if v, r := w.ranges(base); v != 2 || !reflect.DeepEqual(r, want) {
			t.Fatalf("%s at v%d holds %v, want %v", base, v, r, want)
		}
	}
	kv1 := w.engs[w.url("/ii1/")].KV()
	if !kv1.Has(keys[0]) || !kv1.Has(keys[1]) || kv1.Has(keys[2]) || kv1.Has(keys[3]) {
		t.Fatal("ii1 after commit: retained blocks must stay, released ones leave")
	}
	if u := w.engs[w.url("/ii1/")].Stats().KVUtilization; u >= utilBefore {
		t.Fatalf("kv_utilization %v after releasing half, was %v", u, utilBefore)
	}
	if m, _ := w.pc.ShardMap(w.scope.ID(), "c3f8e1"); !reflect.DeepEqual(m, v2) {
		t.Fatalf("the PC's map %+v", m)
	}
	// Commit again: idempotent. A plan from another version than
	// the member's is refused (R-RSH-13).
	ii1 := w.asPC.Instance(w.url("/ii1/"))
	if _, err := ii1.Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: "c3f8e1", Commit: 2}); err != nil {
		t.Fatalf("repeated commit: %v", err)
	}
	for _, from := range []uint64{1, 3} {
		stale := &kvsp.Reshard{Kind: kvsp.ReshardPlan, Map: "c3f8e1", From: from, To: from + 1, DeadlineMs: 200, Retain: []kvsp.TokenRange{{0, 32}},
			ScopeID: w.scope.ID(), CompatID: w.compat}
		if _, err := ii1.Reshard(ctx, stale); !errors.Is(err, kvsp.ErrPlanConflict) {
			t.Fatalf("plan from %d at version 2: %v, want 409 kvsp-plan-conflict", from, err)
		}
	}
	// v3 gives [32,64) back to ii1: the plan names ii2's holder and the
	// range's Block Keys (kvsp's extension members).
	v3 := w.shardMap(3, 0, 64, "/ii1/", 64, 96, "/ii2/", 96, 128, "/ii3/")
	res, err = w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v3, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	f := res.Plans[w.url("/ii1/")].Fetch
	if len(f) != 1 || f[0].From != w.url("/ii2/") || f[0].Holder != w.url("/hb/") || !reflect.DeepEqual(f[0].BlockKeys, keys[2:4]) ||
		res.FetchedBytes[w.url("/ii1/")] != 2*blockLen || res.FetchedBytes[w.url("/ii2/")] != 0 {
		t.Fatalf("v3: ii1's fetch %+v, fetched %v", f, res.FetchedBytes)
	}
}

// TestF12_ReshardDeadlineAbort (RELIABILITY F12; issue 8): a member that
// never acknowledges its plan makes the PC abort after deadline_ms
// (R-RSH-11): every member is sent the abort, the ones that fetched discard
// it (R-RSH-12), version v stays authoritative at the PC and at every
// instance (R-RSH-8), and a late commit of the aborted version is 409
// kvsp-plan-conflict (R-RSH-13). That retained ranges cost zero octets is
// TestReshardRetainsInPlace's; a member that lost its commit catching up,
// TestReshardLostCommitIsResent's.
func TestF12_ReshardDeadlineAbort(t *testing.T) {
	w := newGroup(t)
	ctx := context.Background()
	tokens := prompt(8)[:128]
	keys, _ := kvsp.BlockKeys(w.scope, w.compat, 16, tokens)
	w.fill(t, tokens, 8)
	v1 := w.shardMap(1, 0, 64, "/ii1/", 64, 128, "/ii2/")
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v1, ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: tokens, Deadline: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	// v2 moves [0,32) to ii3 and [96,128) to the stuck member.
	v2 := w.shardMap(2, 0, 32, "/ii3/", 32, 64, "/ii1/", 64, 96, "/ii2/", 96, 128, "/stuck/")
	start := time.Now()
	_, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v2, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 300 * time.Millisecond})
	if !errors.Is(err, placement.ErrReshardAborted) {
		t.Fatalf("reshard with a stuck member: %v", err)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 3*time.Second {
		t.Fatalf("aborted after %v, want about deadline_ms", d)
	}
	w.stuck.mu.Lock()
	aborts := w.stuck.aborts
	w.stuck.mu.Unlock()
	if !reflect.DeepEqual(aborts, []uint64{2}) {
		t.Fatalf("the stuck member received aborts %v", aborts)
	}
	if m, _ := w.pc.ShardMap(w.scope.ID(), "c3f8e1"); !reflect.DeepEqual(m, v1) {
		t.Fatalf("the PC's map after abort %+v, want v1", m)
	}
	for base, want := range map[string][]kvsp.TokenRange{"/ii1/": {{0, 64}}, "/ii2/": {{64, 128}}, "/ii3/": nil} {
		if v, r := w.ranges(base); v != map[string]uint64{"/ii1/": 1, "/ii2/": 1, "/ii3/": 0}[base] || !reflect.DeepEqual(r, want) {
			t.Fatalf("%s after abort at v%d holds %v, want %v", base, v, r, want)
		}
	}
	kv3 := w.engs[w.url("/ii3/")].KV()
	if kv3.Has(keys[0]) || kv3.Has(keys[1]) {
		t.Fatal("ii3 kept the blocks it fetched for the aborted version")
	}
	// ii1 still holds (and serves from its engine) the whole of v1's range.
	for i := range 4 {
		if !w.engs[w.url("/ii1/")].KV().Has(keys[i]) {
			t.Fatalf("ii1 lost block %d of version 1", i)
		}
	}
	// A commit of the aborted version arriving late (a message of the
	// aborted round) changes nothing.
	for _, m := range []string{"/ii1/", "/ii3/"} {
		if _, err := w.asPC.Instance(w.url(m)).Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: "c3f8e1", Commit: 2}); !errors.Is(err, kvsp.ErrPlanConflict) {
			t.Fatalf("a late commit of the aborted version at %s: %v, want 409 kvsp-plan-conflict", m, err)
		}
	}
	if v, r := w.ranges("/ii1/"); v != 1 || !reflect.DeepEqual(r, []kvsp.TokenRange{{0, 64}}) {
		t.Fatalf("ii1 after the late commit: v%d %v", v, r)
	}
	// Abort again: idempotent; a plan for the aborted version can be sent
	// again, and now succeeds without the stuck member.
	if _, err := w.asPC.Instance(w.url("/ii3/")).Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardAbort, Map: "c3f8e1", Abort: 2}); err != nil {
		t.Fatalf("repeated abort: %v", err)
	}
	v2b := w.shardMap(2, 0, 32, "/ii3/", 32, 64, "/ii1/", 64, 128, "/ii2/")
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v2b, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second}); err != nil {
		t.Fatalf("reshard after the abort: %v", err)
	}
	if v, r := w.ranges("/ii3/"); v != 2 || !reflect.DeepEqual(r, []kvsp.TokenRange{{0, 32}}) {
		t.Fatalf("ii3 at v%d holds %v", v, r)
	}
}

// TestReshardPlanConflicts: messages that do not match the instance's map
// version are 409 kvsp-plan-conflict (R-RSH-13, R-RSH-14); a plan without
// deadline_ms is 400 (R-RSH-4); the PC refuses a map that skips a version.
func TestReshardPlanConflicts(t *testing.T) {
	w := newGroup(t)
	ctx := context.Background()
	ii := w.asPC.Instance(w.url("/ii1/"))
	plan := func(from, to uint64) *kvsp.Reshard {
		return &kvsp.Reshard{Kind: kvsp.ReshardPlan, Map: "m1", From: from, To: to, DeadlineMs: 200, ScopeID: w.scope.ID(), CompatID: w.compat}
	}
	for name, m := range map[string]*kvsp.Reshard{
		"from 0 to 2":                plan(0, 2),
		"commit never planned":       {Kind: kvsp.ReshardCommit, Map: "m1", Commit: 1},
		"abort never planned":        {Kind: kvsp.ReshardAbort, Map: "m1", Abort: 5},
		"release of tokens not held": {Kind: kvsp.ReshardPlan, Map: "m1", From: 0, To: 1, DeadlineMs: 200, Release: []kvsp.TokenRange{{0, 16}}, CompatID: w.compat},
	} {
		if _, err := ii.Reshard(ctx, m); !errors.Is(err, kvsp.ErrPlanConflict) {
			t.Errorf("%s: %v, want 409 kvsp-plan-conflict", name, err)
		}
	}
	// An empty first plan is acknowledged; an abort that names another
	// plan (a deposed PC's) does not touch it; its commit moves to 1.
	first := plan(0, 1)
	first.Plan = kvsp.NewUUID()
	if _, err := ii.Reshard(ctx, first); err != nil {
		t.Fatal(err)
	}
	if _, err := ii.Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardAbort, Map: "m1", Abort: 1, Plan: kvsp.NewUUID()}); !errors.Is(err, kvsp.ErrPlanConflict) {
		t.Fatalf("another plan's abort: %v", err)
	}
	if ack, err := ii.Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: "m1", Commit: 1, Plan: first.Plan}); err != nil || ack.Version != 1 {
		t.Fatalf("commit: %+v %v", ack, err)
	}
	if _, err := ii.Reshard(ctx, plan(0, 1)); !errors.Is(err, kvsp.ErrPlanConflict) {
		t.Fatalf("a plan from an old version: %v", err)
	}
	if _, err := ii.Reshard(ctx, plan(3, 4)); err != nil {
		t.Fatalf("a plan from 3 to an instance that holds nothing (it joins): %v", err)
	}
	// Open plans of one version from successive PCs: a later term replaces
	// an open plan, an earlier one (a deposed PC's) does not.
	at := func(term uint64) *kvsp.Reshard { p := plan(3, 4); p.Plan, p.Term = kvsp.NewUUID(), term; return p }
	if _, err := ii.Reshard(ctx, at(5)); err != nil {
		t.Fatal(err)
	}
	if _, err := ii.Reshard(ctx, at(3)); !errors.Is(err, kvsp.ErrPlanConflict) {
		t.Fatalf("an earlier term's plan over an open one: %v", err)
	}
	if _, err := ii.Reshard(ctx, at(7)); err != nil {
		t.Fatalf("a later term's plan: %v", err)
	}
	if _, err := ii.Reshard(ctx, &kvsp.Reshard{Kind: kvsp.ReshardPlan, Map: "m1", From: 1, To: 2}); !errors.Is(err, kvsp.ErrInvalid) {
		t.Fatalf("plan without deadline_ms: %v, want 400", err)
	}
	_, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: w.shardMap(2, 0, 16, "/ii1/"), ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: prompt(1)[:16]})
	if !errors.Is(err, kvsp.ErrPlanConflict) {
		t.Fatalf("PC: a first map at version 2: %v", err)
	}
	_, err = w.front.Controller(w.url("/pc/")).UpdateMap(ctx, &kvsp.MapUpdate{Map: w.shardMap(2, 0, 16, "/ii1/"), ScopeID: w.scope.ID(), CompatID: w.compat,
		Tokens: prompt(1)[:16]})
	if !errors.Is(err, kvsp.ErrPlanConflict) {
		t.Fatalf("PUT maps/{map}: a first map at version 2: %v", err)
	}
}

// TestReshardLostCommitIsResent: a member whose link lost every try of a
// commit (the PC went on at v+1) is sent that commit again before the next
// plan, and the next reshard goes through: no member stays behind with an
// open plan.
func TestReshardLostCommitIsResent(t *testing.T) {
	w := newGroup(t)
	ctx := context.Background()
	tokens := prompt(8)[:128]
	w.fill(t, tokens, 8)
	v1 := w.shardMap(1, 0, 64, "/ii1/", 64, 128, "/flaky/")
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v1, ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: tokens, Deadline: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	if v, _ := w.agents[w.url("/ii3/")].ShardRanges(w.scope.ID(), "c3f8e1"); v != 0 {
		t.Fatalf("the flaky member is at v%d: its commit should have been lost", v)
	}
	v2 := w.shardMap(2, 0, 64, "/ii1/", 64, 96, "/flaky/", 96, 128, "/ii2/")
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v2, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second}); err != nil {
		t.Fatalf("the reshard after a lost commit: %v", err)
	}
	if v, r := w.agents[w.url("/ii3/")].ShardRanges(w.scope.ID(), "c3f8e1"); v != 2 || !reflect.DeepEqual(r, []kvsp.TokenRange{{64, 96}}) {
		t.Fatalf("the flaky member at v%d holds %v", v, r)
	}
}

// TestReshardSharedBlocksStay: two contexts with the same prefix share its
// blocks on ii1; when one map moves away from ii1, the blocks the other
// still holds stay in ii1's engine (pins are counted, R-RSH-5).
func TestReshardSharedBlocksStay(t *testing.T) {
	w := newGroup(t)
	ctx := context.Background()
	tokens := prompt(8)[:64]
	keys, _ := kvsp.BlockKeys(w.scope, w.compat, 16, tokens)
	w.fill(t, tokens, 4)
	for _, m := range []string{"mapA", "mapB"} {
		next := kvsp.ShardMap{Map: m, Version: 1, Shards: []kvsp.Shard{{Tokens: kvsp.TokenRange{0, 64}, Instance: w.url("/ii1/")}}}
		if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: next, ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: tokens, Deadline: 5 * time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	away := kvsp.ShardMap{Map: "mapA", Version: 2, Shards: []kvsp.Shard{{Tokens: kvsp.TokenRange{0, 64}, Instance: w.url("/ii2/")}}}
	if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: away, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second}); err != nil {
		t.Fatal(err)
	}
	kv1 := w.engs[w.url("/ii1/")].KV()
	for i, k := range keys {
		if !kv1.Has(k) {
			t.Fatalf("block %d of mapB left ii1 when mapA moved away", i)
		}
	}
	if v, r := w.agents[w.url("/ii1/")].ShardRanges(w.scope.ID(), "mapB"); v != 1 || !reflect.DeepEqual(r, []kvsp.TokenRange{{0, 64}}) {
		t.Fatalf("mapB at ii1: v%d %v", v, r)
	}
}

// TestF12_ReshardPCCrash (RELIABILITY F12, the crash variants; R-RSH-8,
// R-RSH-12, A-26): the PC, its state in a bbolt file, crashes during a
// reshard from v1 to v2 (a failpoint panics in its goroutine: nothing
// more leaves it) after every member acknowledged, either before it
// recorded the decision or after, before any commit. A PC started on the
// same state resolves what was left open: before the record, v1 stands,
// the plan for v2 is aborted everywhere and the blocks fetched for it are
// dropped; after it, v2 is committed at every member. Either way the
// group converges to exactly one version, and the next reshard goes
// through.
func TestF12_ReshardPCCrash(t *testing.T) {
	for _, point := range []string{"pc/reshard-acked", "pc/reshard-recorded"} {
		t.Run(point, func(t *testing.T) {
			t.Cleanup(failpoint.Reset)
			store, err := placement.OpenBoltStore(filepath.Join(t.TempDir(), "pc.db"))
			if err != nil {
				t.Fatal(err)
			}
			defer store.Close()
			w := newGroupWith(t, store)
			ctx := context.Background()
			tokens := prompt(8)[:128]
			keys, _ := kvsp.BlockKeys(w.scope, w.compat, 16, tokens)
			w.fill(t, tokens, 8)
			v1 := w.shardMap(1, 0, 64, "/ii1/", 64, 128, "/ii2/")
			if _, err := w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v1, ScopeID: w.scope.ID(), CompatID: w.compat, Tokens: tokens, Deadline: 5 * time.Second}); err != nil {
				t.Fatal(err)
			}
			// v2 gives [0,32) to ii3, which fetches it.
			v2 := w.shardMap(2, 0, 32, "/ii3/", 32, 64, "/ii1/", 64, 128, "/ii2/")
			failpoint.Enable(point, "1*panic")
			crashed := make(chan any)
			go func() {
				defer func() { crashed <- recover() }()
				w.pc.Reshard(ctx, &placement.ReshardRequest{Next: v2, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second})
			}()
			if r := <-crashed; r == nil {
				t.Fatal("the PC did not crash at the failpoint")
			}
			if v, _ := w.ranges("/ii3/"); v != 0 || !w.engs[w.url("/ii3/")].KV().Has(keys[0]) {
				t.Fatalf("before the restart ii3 should hold an open plan with its fetched blocks (version %d)", v)
			}
			// The restarted PC, on the same state.
			pc2, err := placement.New(w.pcConfig)
			if err != nil {
				t.Fatal(err)
			}
			rctx, stop := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { pc2.Run(rctx, 20*time.Millisecond); close(done) }()
			defer func() { stop(); <-done }()
			want, wantRanges := uint64(1), map[string][]kvsp.TokenRange{"/ii1/": {{0, 64}}, "/ii2/": {{64, 128}}, "/ii3/": nil}
			if point == "pc/reshard-recorded" {
				want, wantRanges = 2, map[string][]kvsp.TokenRange{"/ii1/": {{32, 64}}, "/ii2/": {{64, 128}}, "/ii3/": {{0, 32}}}
			}
			if m, _ := pc2.ShardMap(w.scope.ID(), "c3f8e1"); m.Version != want {
				t.Fatalf("the restarted PC's map: version %d, want %d", m.Version, want)
			}
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				converged := true
				for base, r := range wantRanges {
					v, got := w.ranges(base)
					if base == "/ii3/" && want == 1 {
						converged = converged && v == 0 && len(got) == 0 && !w.engs[w.url(base)].KV().Has(keys[0])
						continue
					}
					converged = converged && v == want && reflect.DeepEqual(got, r)
				}
				if converged {
					break
				}
				if time.Now().After(deadline) {
					for base := range wantRanges {
						v, got := w.ranges(base)
						t.Logf("%s: v%d %v", base, v, got)
					}
					t.Fatalf("the group did not converge to version %d", want)
				}
			}
			// The next reshard goes through on the restarted PC, once it
			// has recorded the end of the interrupted one (its sweep, every
			// 20 ms, may come after the members converged: 409 until then).
			next := w.shardMap(want+1, 0, 64, "/ii2/", 64, 128, "/ii1/")
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				_, err := pc2.Reshard(ctx, &placement.ReshardRequest{Next: next, ScopeID: w.scope.ID(), CompatID: w.compat, Deadline: 5 * time.Second})
				if err == nil {
					break
				}
				if !errors.Is(err, kvsp.ErrPlanConflict) || time.Now().After(deadline) {
					t.Fatalf("the next reshard: %v", err)
				}
			}
		})
	}
}
