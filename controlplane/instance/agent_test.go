package instance_test

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"errors"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/instance"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/engine/sim"
	"github.com/kvsp/kvsp/holder"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var desc = kvsp.Descriptor{Model: "sim/tiny", ModelDigest: kvsp.Digest{1}, TokenizerDigest: kvsp.Digest{2}, Layers: 4, KVHeads: 2, HeadDim: 16,
	KVDType: "bf16", Positional: "rope", BlockTokens: 16, Layout: "kvsp-layout-1"}

const agentID = "spiffe://kvsp.test/ii"

// rig is a server on loopback with an IS, a source holder (h1), the
// instance's own holder (hi), extra handlers for misbehaving holders, and
// the agent (ii1) on a simulated engine.
type rig struct {
	srv      *kvsptest.Server
	mem      *index.Memory
	ctl      *placement.Controller
	agent    *instance.Agent
	eng      *sim.Engine
	agent2   *instance.Agent
	g        container.Geometry
	compat   kvsp.CompatID
	scopeKey kvsp.ScopeKey
	scopeB   kvsp.ScopeKey    // with rigOptions.scopeB
	pc       *client.Instance // the PC's identity, to the agent
	front    *client.Client   // a front end
	src      *client.Holder   // h1, as a client that fills it
	hi       *client.Holder
	h2       *client.Holder // with rigOptions.h2
	url      func(string) string
	reg      *prometheus.Registry // ii1's metrics
	isURL    string
	// as makes a client with an identity of the rig's PKI; tls is that
	// identity's client TLS configuration.
	as  func(id string) *client.Client
	tls func(id string) *tls.Config
	// producerDigests: the IS runs with producer digests (rigOptions).
	producerDigests bool
}

// rigOptions vary the rig: extra mounts handlers at /bad/; d is the
// engine's descriptor (default desc); noStore leaves the agent without a
// holder of its own.
type rigOptions struct {
	extra   func(r *server.Router)
	d       *kvsp.Descriptor
	noStore bool
	second  bool // a second instance, ii2, on its own engine
	// rdma: h1 serves rdma/reads on an in-process fabric and the agent
	// reads through rdmaReader.
	rdma *countingReader
	// wrapIS, when set, puts the IS on a server of its own whose handler
	// it wraps (S7 records what the IS receives); ctlLog and ctlReg are the
	// IS's and the PC's logger and metrics registry.
	wrapIS func(http.Handler) http.Handler
	ctlLog *slog.Logger
	ctlReg prometheus.Registerer
	// roleLog is the holders' and ii1's agent's logger (S7 scans it).
	roleLog *slog.Logger
	// recordTTL is the holders' record TTL (default a minute); holderReg
	// registers the holders' metrics.
	recordTTL time.Duration
	holderReg prometheus.Registerer
	// sessionRetention is the PC's SessionRetention (default its own).
	sessionRetention time.Duration
	// scopeB adds a second scope (key 0x20..0x3f), which the PC, the
	// agent and h1 serve too: clientB may use it only, ClientA and pcA
	// (a controller) scope A only.
	scopeB bool
	// nondeterministic: ii1's engine declares itself not batch invariant
	// (engine.Engine.Deterministic false), as llama.cpp does.
	nondeterministic bool
	// answerTokens: the simulated engines end each answer at their
	// end-of-generation token after that many tokens (sim.Config).
	answerTokens [2]int
	// linksOf, when set, gives ii1's links (default: h1's only).
	linksOf func(w *rig) []kvsp.Link
	// wrap wraps the handler of the server of every role but the IS.
	wrap func(http.Handler) http.Handler
	// h2 adds a third holder, /h2/ (a client of it: rig.h2);
	// producerDigests runs the IS with producer digests (each key's
	// digest pinned to its first live replica's).
	h2              bool
	producerDigests bool
	// pc edits the PC's configuration.
	pc func(*placement.Config)
	// writeGrace is the server's WriteGrace (zero: its default).
	writeGrace time.Duration
}

// nondeterministic is the rig's engine declaring what llama.cpp declares.
type nondeterministic struct{ *sim.Engine }

func (nondeterministic) Deterministic() bool { return false }

// clientOnly is a principal of scope A with the client role alone: it
// places, generates and reads blocks, and stores none (S13).
const clientOnly = "spiffe://kvsp.test/client/only"

// producerOnly may store blocks in scope A (the producer role), and
// speaks for no instance: it states no producer's digest.
const producerOnly = "spiffe://kvsp.test/producer/tool"

// Identities of the rig's second scope (rigOptions.scopeB).
const (
	clientB = "spiffe://kvsp.test/client/b"
	pcA     = "spiffe://kvsp.test/pc/a"
)

// scopeBKey is the second scope's key.
func scopeBKey() kvsp.ScopeKey {
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(0x20 + i)
	}
	k, _ := kvsp.NewScopeKey(key)
	return k
}

func newRig(t testing.TB, o rigOptions) *rig {
	w := &rig{reg: prometheus.NewRegistry(), producerDigests: o.producerDigests}
	extra := o.extra
	d := desc
	if o.d != nil {
		d = *o.d
	}
	p := kvsptest.NewPKI(t)
	w.mem = index.NewMemory(time.Second)
	t.Cleanup(func() { w.mem.Close() })
	svc, _ := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096, Logger: o.ctlLog, Registerer: o.ctlReg, ProducerDigests: o.producerDigests}, w.mem)
	var isSrv *kvsptest.Server
	if o.wrapIS != nil {
		isSrv = kvsptest.StartServer(t, p, kvsptest.Options{Wrap: o.wrapIS, Logger: o.ctlLog}, func(s *server.Server) { svc.Mount(s.Mount("/is/")) })
	}
	w.srv = kvsptest.StartServer(t, p, kvsptest.Options{Logger: o.ctlLog, Wrap: o.wrap, WriteGrace: o.writeGrace}, func(s *server.Server) {
		if isSrv == nil {
			svc.Mount(s.Mount("/is/"))
		}
		if extra != nil {
			extra(s.Mount("/bad/"))
		}
	})
	w.url = w.srv.URL
	isURL := w.url("/is/")
	if isSrv != nil {
		isURL = isSrv.URL("/is/")
	}
	w.isURL = isURL
	// Identities whose speaks_for carry the server's port.
	scopes := kvsptest.Scope
	if o.scopeB {
		w.scopeB = scopeBKey()
		scopes += ", " + w.scopeB.ID().String()
	}
	pol := `principals:
  - {id: "` + kvsptest.PC + `", roles: [controller], scopes: [` + scopes + `]}
  - {id: "` + kvsptest.Holder1 + `", roles: [holder], speaks_for: ["` + w.url("/h1/") + `", "` + w.url("/hi/") + `", "` + w.url("/h2/") + `", "` + w.url("/bad/") + `"], scopes: [` + scopes + `]}
  - {id: "` + kvsptest.ClientA + `", roles: [client, producer], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + agentID + `", roles: [instance, client], speaks_for: ["` + w.url("/ii1/") + `", "` + w.url("/ii2/") + `"], scopes: [` + scopes + `]}
  - {id: "` + clientOnly + `", roles: [client], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + producerOnly + `", roles: [producer], scopes: [` + kvsptest.Scope + `]}
`
	if o.scopeB {
		pol += `  - {id: "` + clientB + `", roles: [client], scopes: [` + w.scopeB.ID().String() + `]}
  - {id: "` + pcA + `", roles: [controller], scopes: [` + kvsptest.Scope + `]}
`
	}
	os.WriteFile(p.Path("policy.yaml"), []byte(pol), 0o644)
	if err := w.srv.Policy.Reload(); err != nil {
		t.Fatal(err)
	}
	if isSrv != nil {
		if err := isSrv.Policy.Reload(); err != nil {
			t.Fatal(err)
		}
	}
	mk := func(id string) *client.Client {
		c, _ := client.New(client.Config{TLS: p.ClientTLS(p.Leaf(id)), Attempts: 1})
		t.Cleanup(c.Close)
		return c
	}
	w.as = mk
	w.tls = func(id string) *tls.Config { return p.ClientTLS(p.Leaf(id)) }
	hc := mk(kvsptest.Holder1)
	var err error
	w.compat, _ = d.CompatID()
	w.eng, err = sim.New(sim.Config{Descriptor: d, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000, BatchSize: 4, KVBlocks: 256, AnswerTokens: o.answerTokens})
	if err != nil {
		t.Fatal(err)
	}
	w.g = w.eng.Geometry()
	var target holder.RDMA
	if o.rdma != nil {
		fab := rdma.NewFabric()
		tg := rdma.NewTarget(fab.Provider("h1"))
		t.Cleanup(func() { tg.Close() })
		target = tg
		o.rdma.Reader = rdma.NewReader(fab.Provider("ii1"))
		t.Cleanup(func() { o.rdma.Reader.Close() })
	}
	recordTTL := cmp.Or(o.recordTTL, time.Minute)
	bases := []string{"/h1/", "/hi/"}
	if o.h2 {
		bases = append(bases, "/h2/")
	}
	for _, base := range bases {
		var reg prometheus.Registerer
		if o.holderReg != nil {
			reg = prometheus.WrapRegistererWith(prometheus.Labels{"holder": base}, o.holderReg)
		}
		hcfg := holder.Config{Base: w.url(base), Geometries: map[kvsp.CompatID]container.Geometry{w.compat: w.g}, Capacity: 512 << 20,
			ReadMbitPerS: 100000, Index: hc.Index(isURL), RecordTTL: recordTTL, Registerer: reg, Logger: o.roleLog,
			LeaseQuota: holder.LeaseQuota{Octets: 512 << 20, MaxTTL: time.Minute, MaxLeases: 256}}
		if base == "/h1/" && target != nil {
			hcfg.RDMA = target
		}
		h, err := holder.New(hcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close(context.Background()) })
		h.Mount(w.srv.Server.Mount(base))
	}
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i)
	}
	w.scopeKey, _ = kvsp.NewScopeKey(key)
	keys := []kvsp.ScopeKey{w.scopeKey}
	if o.scopeB {
		keys = append(keys, w.scopeB)
	}
	pcfg := placement.Config{Scopes: keys, BlockTokens: map[kvsp.CompatID]int{w.compat: 16},
		Index: mk(kvsptest.PC).Index(isURL), Instances: placement.ClientInstances{C: mk(kvsptest.PC)}, Logger: o.ctlLog, Registerer: o.ctlReg,
		SessionRetention: o.sessionRetention}
	if o.pc != nil {
		o.pc(&pcfg)
	}
	if w.ctl, err = placement.New(pcfg); err != nil {
		t.Fatal(err)
	}
	w.ctl.Mount(w.srv.Server.Mount("/pc/"))
	own := w.url("/hi/")
	if o.noStore {
		own = ""
	}
	var eng engine.Engine = w.eng
	if o.nondeterministic {
		eng = nondeterministic{w.eng}
	}
	icfg := instance.Config{Base: w.url("/ii1/"), Engine: eng, Client: mk(agentID), Index: isURL, Holder: own, ProducerDigests: o.producerDigests,
		Controller: w.url("/pc/"), StatusTTL: 300 * time.Millisecond, Scopes: keys, Workers: 4, MaxPending: 4,
		Links: []kvsp.Link{{Holder: w.url("/h1/"), MbitPerS: 100000, RTTUs: 20}}, Registerer: w.reg, Logger: o.roleLog}
	if o.rdma != nil {
		get := instance.GetFetcher{Client: icfg.Client}
		icfg.Fetcher = instance.RDMAFetcher{Client: icfg.Client, Reader: o.rdma, Fallback: get, Logger: o.roleLog}
	}
	if o.linksOf != nil {
		icfg.Links = o.linksOf(w)
	}
	w.agent, err = instance.New(icfg)
	if err != nil {
		t.Fatal(err)
	}
	w.agent.Mount(w.srv.Server.Mount("/ii1/"))
	if o.second {
		eng2, _ := sim.New(sim.Config{Descriptor: d, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000, BatchSize: 4, KVBlocks: 256, AnswerTokens: o.answerTokens})
		w.agent2, err = instance.New(instance.Config{Base: w.url("/ii2/"), Engine: eng2, Client: mk(agentID), Index: isURL,
			Controller: w.url("/pc/"), StatusTTL: 300 * time.Millisecond, Scopes: []kvsp.ScopeKey{w.scopeKey},
			Links: []kvsp.Link{{Holder: w.url("/h1/"), MbitPerS: 100000, RTTUs: 20}, {Holder: w.url("/hi/"), MbitPerS: 100000, RTTUs: 20}}})
		if err != nil {
			t.Fatal(err)
		}
		w.agent2.Mount(w.srv.Server.Mount("/ii2/"))
	}
	w.pc = mk(kvsptest.PC).Instance(w.url("/ii1/"))
	w.front = mk(kvsptest.ClientA)
	w.src = w.front.Holder(w.url("/h1/"))
	w.hi = w.front.Holder(w.url("/hi/"))
	if o.h2 {
		w.h2 = w.front.Holder(w.url("/h2/"))
	}
	return w
}

// countingReader counts the RDMA reads that completed.
type countingReader struct {
	*rdma.Reader
	reads atomic.Int64
}

func (c *countingReader) Read(ctx context.Context, holder string, dst []byte, addr uint64, rkey uint32) error {
	err := c.Reader.Read(ctx, holder, dst, addr, rkey)
	if err == nil {
		c.reads.Add(1)
	}
	return err
}

// TestGenerateWaitsForItsPrefetch: a request whose blocks the PC's
// directive (request_ref: the session) is loading starts its prefill once
// they are loaded, so it reuses them all and computes only the tail.
func TestGenerateWaitsForItsPrefetch(t *testing.T) {
	w := newRig(t, rigOptions{})
	tokens := prompt(4)
	session, _ := w.prefetchForSession(t, tokens)
	err := w.front.Instance(w.url("/ii1/")).Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: session, Epoch: 1, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 2}), func(kvsp.GeneratedToken) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	cached := testutil.ToFloat64(counterOf(t, w.reg, "kvsp_instance_prompt_tokens_total", "cached"))
	computed := testutil.ToFloat64(counterOf(t, w.reg, "kvsp_instance_prompt_tokens_total", "computed"))
	if cached != 64 || computed != 3 {
		t.Fatalf("prompt tokens: %v cached, %v computed; want 64 and 3 (the tail)", cached, computed)
	}
}

// granted is q with the grant a PC would have sealed for it at ii1 (the
// rig's first agent): tests that call generate without a place.
func (w *rig) granted(t testing.TB, q *kvsp.GenerateRequest) *kvsp.GenerateRequest {
	return w.grantAt(t, w.agent, w.url("/ii1/"), q)
}

// grantAt seals q's grant for the agent a at base.
func (w *rig) grantAt(t testing.TB, a *instance.Agent, base string, q *kvsp.GenerateRequest) *kvsp.GenerateRequest {
	t.Helper()
	key := w.scopeKey
	if q.ScopeID == scopeBKey().ID() {
		key = scopeBKey()
	}
	keys, err := kvsp.BlockKeys(key, q.CompatID, int(w.g.BlockTokens), q.Tokens)
	if err != nil {
		t.Fatal(err)
	}
	g := kvsp.Grant{ID: kvsp.NewGrantID(), Session: q.Session, Epoch: q.Epoch, ScopeID: q.ScopeID, CompatID: q.CompatID,
		Prompt: kvsp.PromptDigest(keys, q.Tokens[len(keys)*int(w.g.BlockTokens):]), MaxTokens: q.MaxTokens,
		Instance: base, InstanceEpoch: a.Status().Epoch, Expires: time.Now().Add(time.Minute)}
	if q.Grant, err = g.Seal(key); err != nil {
		t.Fatal(err)
	}
	return q
}

// floodKV writes n blocks no request uses into the rig's engine, enough
// to evict everything unpinned from its 256-block KV.
func (w *rig) floodKV(t *testing.T, n int) {
	t.Helper()
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	for i := range n {
		var key kvsp.BlockKey
		key[0], key[1], key[2] = 0xef, byte(i), byte(i>>8)
		for l := uint32(0); l < w.g.Layers; l++ {
			if err := w.eng.KV().WriteLayer(key, l, k, v); err != nil {
				t.Fatalf("filling the KV: %v", err)
			}
		}
	}
}

// TestPrefetchedBlocksStayForTheirRequest: what a directive loaded for a
// request (request_ref) stays resident until that request's prefill, even
// when other prefills fill the engine's KV meanwhile (as a queue of them
// does under load). Removing the directive's pins fails it: the flood
// evicts the loaded blocks and the request computes its whole prompt.
func TestPrefetchedBlocksStayForTheirRequest(t *testing.T) {
	w := newRig(t, rigOptions{})
	tokens := prompt(4)
	session, d := w.prefetchForSession(t, tokens)
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete {
		t.Fatalf("directive %s", st.State)
	}
	w.floodKV(t, 600)
	var cached uint64
	err := w.front.Instance(w.url("/ii1/")).Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: session, Epoch: 1, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 2}), func(t kvsp.GeneratedToken) error {
		if t.Prefill != nil {
			cached = t.Prefill.CachedTokens
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if cached != 64 {
		t.Fatalf("cached %d prompt tokens after the flood; want 64 (the 4 blocks the directive loaded)", cached)
	}
	// The request has them now: the directive holds no pin any more.
	for i, k := range d.Blocks {
		if stillPinned(w.eng.KV(), k.BlockKey) {
			t.Fatalf("block %d still pinned after its request ended", i)
		}
	}
}

// TestPrefetchPinsGoWithoutTheirRequest: a directive whose request never
// comes does not hold its blocks for longer than its lease_ms.
func TestPrefetchPinsGoWithoutTheirRequest(t *testing.T) {
	w := newRig(t, rigOptions{})
	tokens := prompt(4)
	keys := w.fill(t, tokens, 4)
	d := w.directive(keys[:4], func(int) []string { return []string{w.url("/h1/")} }, 5000)
	d.RequestRef, d.LeaseMs = kvsp.NewUUID().String(), 100
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete {
		t.Fatalf("directive %s", st.State)
	}
	if !stillPinned(w.eng.KV(), keys[0]) {
		t.Fatal("the directive does not keep what it loaded for its request")
	}
	kvsptest.WaitFor(t, "the directive's pins to go after lease_ms", func() bool { return !stillPinned(w.eng.KV(), keys[0]) })
	w.floodKV(t, 600)
	if w.eng.KV().Has(keys[0]) {
		t.Fatal("a block loaded for a request that never came survived the flood")
	}
}

// stillPinned reports whether someone pins key, leaving its pins as they
// were.
func stillPinned(kv engine.KV, key kvsp.BlockKey) bool {
	return kv.Pin(key) && kv.Unpin(key)
}

// counterOf finds the counter name{source=label} in reg.
func counterOf(t *testing.T, reg *prometheus.Registry, name, label string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetValue() == label {
					return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x"}, func() float64 { return m.GetCounter().GetValue() })
				}
			}
		}
	}
	t.Fatalf("no %s{%s}", name, label)
	return nil
}

// TestPrefetchByRDMA: with an RDMA reader, blocks of a holder that serves
// rdma/reads are loaded by one-sided READ (verified whole, then placed:
// the engine's own bytes), and a holder that does not (the instance's own
// holder, /hi/) is read by GET.
func TestPrefetchByRDMA(t *testing.T) {
	cr := &countingReader{}
	w := newRig(t, rigOptions{rdma: cr})
	keys := w.fill(t, prompt(4), 4)
	w.prefetchAll(t, keys[:4], w.url("/h1/"))
	if n := cr.reads.Load(); n != 4 {
		t.Fatalf("%d blocks read by RDMA, want 4", n)
	}
	w.engineHolds(t, keys[:4])
	// /hi/ (the instance's own holder, now holding them) has no RDMA: a
	// second instance-side load from it falls back to GET.
	w.waitPublished(t, keys[:4], w.url("/hi/"))
	for _, key := range keys[:4] {
		w.eng.KV().Drop(key)
	}
	w.prefetchAll(t, keys[:4], w.url("/hi/"))
	if n := cr.reads.Load(); n != 4 {
		t.Fatalf("%d RDMA reads after the GET fallback, want still 4", n)
	}
	w.engineHolds(t, keys[:4])
	// Loaded from h1, each block was stored once at the instance's own
	// holder; loaded from there, none is offered back to it (offloads are
	// asynchronous: any would show within a few loopback PUTs).
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if exists := offloadsExisting(t, w); exists != 0 {
			t.Fatalf("%v blocks loaded from the instance's own holder were offered back to it", exists)
		}
	}
	if stored := testutil.ToFloat64(counterOf(t, w.reg, "kvsp_instance_offloads_total", "stored")); stored != 4 {
		t.Fatalf("%v blocks stored at the instance's holder, want 4", stored)
	}
}

// TestCopyOnlyToACloserHolder: a block loaded from another holder is
// copied to the instance's own only when the own holder's link moves a
// block faster; over links alike it is not (counted not_closer), and
// with no link of its own holder configured it is, as before links were
// weighed. Mutation: copying whatever the links fails the second case.
func TestCopyOnlyToACloserHolder(t *testing.T) {
	for _, c := range []struct {
		name   string
		links  func(w *rig) []kvsp.Link
		copied bool
	}{
		{"own holder closer", func(w *rig) []kvsp.Link {
			return []kvsp.Link{{Holder: w.url("/h1/"), MbitPerS: 10000, RTTUs: 200}, {Holder: w.url("/hi/"), MbitPerS: 100000, RTTUs: 20}}
		}, true},
		{"links alike", func(w *rig) []kvsp.Link {
			return []kvsp.Link{{Holder: w.url("/h1/"), MbitPerS: 100000, RTTUs: 20}, {Holder: w.url("/hi/"), MbitPerS: 100000, RTTUs: 20}}
		}, false},
		{"own link unknown", nil, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := newRig(t, rigOptions{linksOf: c.links})
			keys := w.fill(t, prompt(4), 4)
			w.prefetchAll(t, keys[:4], w.url("/h1/"))
			w.engineHolds(t, keys[:4])
			notCloser := testutil.ToFloat64(offloadCounter(t, w, "not_closer"))
			if c.copied {
				deadline := time.Now().Add(10 * time.Second)
				for testutil.ToFloat64(offloadCounter(t, w, "stored")) < 4 {
					if time.Now().After(deadline) {
						t.Fatalf("%v of 4 loaded blocks copied to the instance's holder", testutil.ToFloat64(offloadCounter(t, w, "stored")))
					}
					time.Sleep(10 * time.Millisecond)
				}
				if notCloser != 0 {
					t.Fatalf("%v blocks counted not_closer", notCloser)
				}
				return
			}
			if notCloser != 4 {
				t.Fatalf("%v blocks counted not_closer, want 4", notCloser)
			}
			for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
				if n := testutil.ToFloat64(offloadCounter(t, w, "stored")); n != 0 {
					t.Fatalf("%v blocks copied over a link no faster than the source's", n)
				}
			}
		})
	}
}

// offloadCounter is kvsp_instance_offloads_total{outcome} of ii1 (0 while
// the series does not exist).
func offloadCounter(t *testing.T, w *rig, outcome string) prometheus.Collector {
	mfs, _ := w.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "kvsp_instance_offloads_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if m.GetLabel()[0].GetValue() == outcome {
				v := m.GetCounter().GetValue()
				return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x"}, func() float64 { return v })
			}
		}
	}
	return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "x"}, func() float64 { return 0 })
}

// offloadsExisting counts the offloads the instance's holder already had.
func offloadsExisting(t *testing.T, w *rig) float64 {
	mfs, _ := w.reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "kvsp_instance_offloads_total" {
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == "exists" {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

// prefetchAll has the agent load keys from src and waits until it did.
func (w *rig) prefetchAll(t *testing.T, keys []kvsp.BlockKey, src string) {
	t.Helper()
	d := w.directive(keys, func(int) []string { return []string{src} }, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete || len(st.Loaded) != len(keys) {
		t.Fatalf("prefetch from %s: %+v", src, st)
	}
}

// engineHolds checks that the engine's KV of keys is the bytes the
// engine would have computed itself.
func (w *rig) engineHolds(t *testing.T, keys []kvsp.BlockKey) {
	t.Helper()
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	wk, wv := make([]byte, len(k)), make([]byte, len(v))
	for i, key := range keys {
		for l := uint32(0); l < w.g.Layers; l++ {
			if err := w.eng.KV().ReadLayer(key, l, k, v); err != nil {
				t.Fatal(err)
			}
			sim.BlockContent(w.g, key, l, wk, wv)
			if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
				t.Fatalf("block %d layer %d: loaded bytes differ from the engine's own", i, l)
			}
		}
	}
}

func prompt(blocks int) []uint32 {
	out := make([]uint32, blocks*16+3)
	for i := range out {
		out[i] = uint32(11*i + 5)
	}
	return out
}

// runAgents runs the status loops of the agents at the given paths for
// the rest of the test, and waits until the PC knows each as active.
func (w *rig) runAgents(tb testing.TB, paths ...string) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	tb.Cleanup(func() { cancel(); wg.Wait() })
	for _, p := range paths {
		a := map[string]*instance.Agent{"/ii1/": w.agent, "/ii2/": w.agent2}[p]
		wg.Add(1)
		go func() { defer wg.Done(); a.Run(ctx) }()
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, p := range paths {
		for {
			if s, ok := w.ctl.Registry().Get(w.url(p)); ok && s.State == kvsp.StateActive {
				break
			}
			if time.Now().After(deadline) {
				tb.Fatalf("the PC does not know %s", p)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// container of block i of tokens, as the engine computes it.
func (w *rig) blockBytes(t testing.TB, tokens []uint32, i int) ([]byte, container.Digests) {
	hdr, _ := container.NewHeader(container.CodecRaw, 0, w.g.Layers, w.g)
	var buf bytes.Buffer
	cw := container.NewWriter(&buf, hdr)
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	h := keys[i]
	for l := uint32(0); l < w.g.Layers; l++ {
		sim.BlockContent(w.g, h, l, k, v)
		cw.WriteLayer(k, v)
	}
	d, err := cw.Close()
	if err != nil {
		t.Fatal(err)
	}
	return buf.Bytes(), d
}

// fill stores the first n blocks of tokens at h1 (which publishes them).
func (w *rig) fill(t testing.TB, tokens []uint32, n int) []kvsp.BlockKey {
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	for i := 0; i < n; i++ {
		b, d := w.blockBytes(t, tokens, i)
		if w.producerDigests { // the producer states the digest first, as an instance does
			st := &kvsp.ProducerRecord{BlockKey: keys[i], ScopeID: w.scopeKey.ID(), CompatID: w.compat, Producer: w.url("/ii1/"), Digest: kvsp.Digest(container.ReplicaDigest(d.Layers)), TTLMs: 60000}
			if _, err := w.as(agentID).Index(w.isURL).StateDigest(context.Background(), st); err != nil {
				t.Fatal(err)
			}
		}
		ref := client.BlockRef{Compat: w.compat, Scope: w.scopeKey.ID(), Key: keys[i]}
		if err := w.src.PutBlock(context.Background(), ref, bytes.NewReader(b), int64(len(b)), d.Container); err != nil {
			t.Fatal(err)
		}
	}
	w.waitPublished(t, keys[:n], w.url("/h1/"))
	return keys
}

func (w *rig) waitPublished(t testing.TB, keys []kvsp.BlockKey, holderBase string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := w.front.Index(w.isURL).Lookup(context.Background(), &kvsp.LookupRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, BlockKeys: keys})
		if err == nil && resp.Matched == len(keys) {
			ok := true
			for _, reps := range resp.Replicas {
				found := false
				for _, r := range reps {
					found = found || r.Holder == holderBase
				}
				ok = ok && found
			}
			if ok {
				return
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%d keys not published by %s", len(keys), holderBase)
}

// prefetchForSession puts tokens' four blocks at h1 and sends the agent
// a directive for them with request_ref a new session, returning it.
func (w *rig) prefetchForSession(t *testing.T, tokens []uint32) (kvsp.UUID, *kvsp.PrefetchDirective) {
	t.Helper()
	keys := w.fill(t, tokens, 4)
	session := kvsp.NewUUID()
	d := w.directive(keys[:4], func(int) []string { return []string{w.url("/h1/")} }, 5000)
	d.RequestRef = session.String()
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	return session, d
}

func (w *rig) directive(keys []kvsp.BlockKey, sources func(i int) []string, deadlineMs uint64) *kvsp.PrefetchDirective {
	d := &kvsp.PrefetchDirective{Directive: kvsp.NewUUID(), RequestRef: "r1", ScopeID: w.scopeKey.ID(), CompatID: w.compat,
		LayerOrder: "ascending", DeadlineMs: deadlineMs, LeaseMs: 5000}
	for i, k := range keys {
		d.Blocks = append(d.Blocks, kvsp.PrefetchBlock{BlockKey: k, Sources: sources(i)})
	}
	return d
}

func (w *rig) wait(t testing.TB, id kvsp.UUID) *kvsp.PrefetchStatus {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		st, err := w.pc.PrefetchStatus(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if st.State != kvsp.PrefetchPending {
			return st
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("directive still pending")
	return nil
}

func tokensOf(t *testing.T, e engine.Engine, req engine.Request) []uint32 {
	var out []uint32
	if _, err := e.Generate(context.Background(), req, func(tok engine.Token) error { out = append(out, tok.ID); return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPrefetchLoadsVerified: R-PF-2/4..9, A-17, A-18: a directive is
// accepted with 202 and Location, loads every block under a lease with
// layer digests verified, places the exact bytes the engine would have
// computed (a generation gives the same tokens as a cold engine), stores
// them at the instance's holder, which publishes them, and reports
// complete; a re-POST with the same body is accepted again, another body
// with the same id is 409.
func TestPrefetchLoadsVerified(t *testing.T) {
	w := newRig(t, rigOptions{})
	tokens := prompt(6)
	keys := w.fill(t, tokens, 6)
	d := w.directive(keys[:6], func(int) []string { return []string{w.url("/h1/")} }, 5000)
	loc, err := w.pc.Prefetch(context.Background(), d)
	if err != nil || loc != "prefetch/"+d.Directive.String() {
		t.Fatalf("POST prefetch: %q %v", loc, err)
	}
	st := w.wait(t, d.Directive)
	if st.State != kvsp.PrefetchComplete || len(st.Loaded) != 6 || st.Loaded[5] != keys[5] || len(st.Failed) != 0 {
		t.Fatalf("status %+v", st)
	}
	w.engineHolds(t, keys[:6])
	cold, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000})
	req := engine.Request{Tokens: tokens, Keys: keys, MaxTokens: 8, Sampler: engine.Sampler{Method: engine.Greedy}}
	if a, b := tokensOf(t, w.eng, req), tokensOf(t, cold, req); !equal(a, b) {
		t.Fatalf("prefetched %v, cold %v", a, b)
	}
	w.waitPublished(t, keys[:6], w.url("/hi/")) // stored at its holder, published
	body, _ := kvsp.Marshal(d)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatalf("identical re-POST: %v (body %d octets)", err, len(body))
	}
	d.DeadlineMs++
	if _, err := w.pc.Prefetch(context.Background(), d); !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("same id, another body: %v", err)
	}
}

// TestPrefetchLooksUpWhileLeasing: a directive's two round trips before
// its first GET, the IS lookup for layer digests and the lease at the
// blocks' holder, are under way at once, so the deadline pays for one of
// them. The IS holds the lookup until the holder has seen the lease, and
// the holder holds the lease until the IS has seen the lookup, each for
// longer than the directive's deadline: asked one after the other, the
// first waits past the deadline and nothing loads.
func TestPrefetchLooksUpWhileLeasing(t *testing.T) {
	var (
		armed                 atomic.Bool
		lookupSeen, leaseSeen = make(chan struct{}), make(chan struct{})
		lookupOnce, leaseOnce sync.Once
		hold                  = 4 * time.Second // past the deadline below
	)
	meet := func(once *sync.Once, mine, other chan struct{}) {
		once.Do(func() { close(mine) })
		select {
		case <-other:
		case <-time.After(hold):
		}
	}
	w := newRig(t, rigOptions{
		wrapIS: func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				if armed.Load() && r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/is/lookup") {
					meet(&lookupOnce, lookupSeen, leaseSeen)
				}
				h.ServeHTTP(rw, r)
			})
		},
		wrap: func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				if armed.Load() && r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/h1/leases") {
					meet(&leaseOnce, leaseSeen, lookupSeen)
				}
				h.ServeHTTP(rw, r)
			})
		},
	})
	keys := w.fill(t, prompt(4), 4)
	armed.Store(true)
	d := w.directive(keys[:4], func(int) []string { return []string{w.url("/h1/")} }, 2500)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete || len(st.Loaded) != 4 {
		t.Fatalf("status %+v: the lookup and the lease were not under way at once", st)
	}
	w.engineHolds(t, keys[:4])
}

func equal(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// badHolder answers leases, and serves for every block a well-formed
// container of other content with its own Repr-Digest, or hangs (for keys
// in hang) until the client gives up.
type badHolder struct {
	w    *rig
	hang map[string]bool
	cut  map[string][]byte // keys served truthfully up to half, then the connection is cut
	gets chan string
}

func (b *badHolder) mount(r *server.Router) {
	callers := server.Route{Roles: []server.Role{server.RoleClient, server.RoleInstance}}
	r.Handle("POST", "leases", callers, func(rw http.ResponseWriter, req *http.Request) error {
		var q kvsp.LeaseRequest
		if err := server.DecodeJSON(req, &q); err != nil {
			return err
		}
		rw.Header().Set("Location", "leases/x")
		return server.WriteJSON(rw, http.StatusCreated, &kvsp.LeaseResponse{Lease: "x", TTLMs: q.TTLMs, BlockKeys: q.BlockKeys})
	})
	r.Handle("DELETE", "leases/{id}", callers, func(rw http.ResponseWriter, req *http.Request) error { return server.NoContent(rw) })
	r.Handle("GET", "blocks/{compat}/{scope}/{key}", server.Route{Roles: callers.Roles, MaxBody: -1}, func(rw http.ResponseWriter, req *http.Request) error {
		key := req.PathValue("key")
		select {
		case b.gets <- key:
		default:
		}
		if b.hang[key] {
			<-req.Context().Done()
			return req.Context().Err()
		}
		if body := b.cut[key]; body != nil { // a holder killed mid-transfer
			rw.Header().Set("Content-Type", kvsp.MediaTypeBlock)
			rw.Header().Set("Repr-Digest", container.ReprDigest(container.Digest(sha256.Sum256(body))))
			rw.Header().Set("Content-Length", strconv.Itoa(len(body)))
			rw.Write(body[:len(body)/2])
			rw.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		body, d := b.w.blockBytes(nil, prompt(2), 0) // another prefix's block
		rw.Header().Set("Content-Type", kvsp.MediaTypeBlock)
		rw.Header().Set("Repr-Digest", container.ReprDigest(d.Container))
		rw.Write(body)
		return nil
	})
}

// claim publishes records for the bad holder with the true layer digests
// of tokens' blocks (a holder claiming replicas it does not have).
func (w *rig) claim(t *testing.T, tokens []uint32, keys []kvsp.BlockKey, blocks ...int) {
	for _, i := range blocks {
		_, d := w.blockBytes(t, tokens, i)
		r := &kvsp.ReplicaRecord{BlockKey: keys[i], CompatID: w.compat, ScopeID: w.scopeKey.ID(), Holder: w.url("/bad/"), Codec: 1,
			Size: 1, Digest: kvsp.Digest{1}, TTLMs: 60000, Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, w.g.Layers - 1}}}}
		for _, l := range d.Layers {
			r.LayerDigests = append(r.LayerDigests, kvsp.LayerDigest(l))
		}
		if _, err := w.mem.Put(context.Background(), r, time.Minute, index.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPrefetchFallbackPartialDeadline: a source whose bytes fail the layer
// digests is counted and the next source used (never unverified bytes in
// the engine); a block no source can serve ends the directive partial with
// the leading prefix loaded; the deadline stops a transfer that hangs
// a draining instance refuses new directives (R-ST-14, A-36).
func TestPrefetchFallbackPartialDeadline(t *testing.T) {
	bad := &badHolder{hang: map[string]bool{}, gets: make(chan string, 64)}
	w := newRig(t, rigOptions{extra: bad.mount})
	bad.w = w
	tokens := prompt(5)
	keys := w.fill(t, tokens, 3) // h1 has blocks 0-2 only
	w.claim(t, tokens, keys, 0, 1, 2, 3, 4)
	bad.hang[keys[4].String()] = true

	// Blocks 0-2: bad first, then h1. Block 3: bad only (wrong bytes).
	d := w.directive(keys[:4], func(i int) []string {
		if i < 3 {
			return []string{w.url("/bad/"), w.url("/h1/")}
		}
		return []string{w.url("/bad/")}
	}, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	st := w.wait(t, d.Directive)
	if st.State != kvsp.PrefetchPartial || len(st.Loaded) != 3 || len(st.Failed) != 1 || st.Failed[0] != keys[3] {
		t.Fatalf("status %+v", st)
	}
	tried := map[string]bool{}
	for len(bad.gets) > 0 {
		tried[<-bad.gets] = true
	}
	for i := 0; i < 4; i++ {
		if !tried[keys[i].String()] {
			t.Fatalf("block %d was not tried at the bad source first", i)
		}
	}
	if w.eng.KV().Has(keys[3]) {
		t.Fatal("a block that failed verification is in the engine")
	}
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	wk, wv := make([]byte, len(k)), make([]byte, len(v))
	w.eng.KV().ReadLayer(keys[2], 3, k, v)
	sim.BlockContent(w.g, keys[2], 3, wk, wv)
	if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
		t.Fatal("the fallback source's bytes are not the right ones")
	}

	// Block 2 from h1, then block 4 whose only source hangs: the deadline
	// ends the directive, partial with the leading block loaded.
	w.eng.KV().Drop(keys[2])
	t0 := time.Now()
	d2 := w.directive([]kvsp.BlockKey{keys[2], keys[4]}, func(i int) []string {
		if i == 0 {
			return []string{w.url("/h1/")}
		}
		return []string{w.url("/bad/")}
	}, 300)
	if _, err := w.pc.Prefetch(context.Background(), d2); err != nil {
		t.Fatal(err)
	}
	st = w.wait(t, d2.Directive)
	if st.State != kvsp.PrefetchPartial || len(st.Loaded) != 1 || st.Loaded[0] != keys[2] || len(st.Failed) != 1 ||
		time.Since(t0) < 300*time.Millisecond || time.Since(t0) > 3*time.Second || !w.eng.KV().Has(keys[2]) {
		t.Fatalf("deadline: %+v after %v", st, time.Since(t0))
	}
	// With nothing loaded by the deadline it is failed.
	d3 := w.directive(keys[4:5], func(int) []string { return []string{w.url("/bad/")} }, 200)
	if _, err := w.pc.Prefetch(context.Background(), d3); err != nil {
		t.Fatal(err)
	}
	if st = w.wait(t, d3.Directive); st.State != kvsp.PrefetchFailed || len(st.Failed) != 1 {
		t.Fatalf("deadline, nothing loaded: %+v", st)
	}

	// Draining with nothing in progress settles to sleeping at once
	// (R-ST-15); no new directives then; sleeping cannot drain;
	// the PC can make it active again.
	if st, err := w.pc.SetState(context.Background(), kvsp.StateDraining); err != nil || st.State != kvsp.StateSleeping {
		t.Fatalf("draining with nothing to do: %v %v", st, err)
	}
	if _, err := w.pc.Prefetch(context.Background(), w.directive(keys[:1], func(int) []string { return []string{w.url("/h1/")} }, 100)); !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("prefetch while sleeping: %v", err)
	}
	if _, err := w.pc.SetState(context.Background(), kvsp.StateDraining); !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("sleeping to draining: %v", err)
	}
	if st, err := w.pc.SetState(context.Background(), kvsp.StateActive); err != nil || st.State != kvsp.StateActive {
		t.Fatalf("wake: %v %v", st, err)
	}
}

// TestStatusPlaceGenerate: the agent reports status every ttl/3 (R-ST-1)
// and the PC knows it (epoch from its start time, its model, active); a
// request placed by the PC is run by POST generate, tokens streamed with
// their index and the session's epoch; draining lets the running
// generation deliver every token (R-ST-13), refuses new ones (R-ST-14),
// then sleeps (R-ST-15).
func TestStatusPlaceGenerate(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	if s, _ := w.ctl.Registry().Get(w.url("/ii1/")); s.Status.CompatID != w.compat || s.Status.Epoch < 1e12 || len(s.Status.Links) != 1 {
		t.Fatalf("the instance's status at the PC: %+v", s.Status)
	}
	tokens := prompt(3)
	w.fill(t, tokens, 3)
	pl, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 600})
	if err != nil || pl.Instance != w.url("/ii1/") || pl.Matched != 3 || pl.Directive == nil {
		t.Fatalf("place: %+v %v", pl, err)
	}
	ii := w.front.Instance(pl.Instance)
	var got []kvsp.GeneratedToken
	gen := make(chan error, 1)
	go func() {
		gen <- ii.Generate(context.Background(), &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, Grant: pl.Grant, ScopeID: w.scopeKey.ID(),
			CompatID: w.compat, Tokens: tokens, MaxTokens: 600}, func(tok kvsp.GeneratedToken) error { got = append(got, tok); return nil })
	}()
	time.Sleep(20 * time.Millisecond) // the generation is running
	if st, err := w.pc.SetState(context.Background(), kvsp.StateDraining); err != nil || st.State != kvsp.StateDraining {
		t.Fatalf("drain while generating: %v %v", st, err)
	}
	err = ii.Generate(context.Background(), w.granted(t, &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 1}), func(kvsp.GeneratedToken) error { return nil })
	if !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("a new generation while draining: %v", err)
	}
	if err := <-gen; err != nil {
		t.Fatal(err)
	}
	if len(got) != 600 || got[599].Index != 599 || got[0].Epoch != pl.Epoch {
		t.Fatalf("%d tokens, last %+v", len(got), got[len(got)-1])
	}
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	cold, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000})
	want := tokensOf(t, cold, engine.Request{Tokens: tokens, Keys: keys, MaxTokens: 600, Sampler: engine.Sampler{Method: engine.Greedy}})
	for i := range want {
		if got[i].Token != want[i] {
			t.Fatalf("token %d: %d, want %d", i, got[i].Token, want[i])
		}
	}
	if s := w.agent.State(); s != kvsp.StateSleeping {
		t.Fatalf("after draining: %s, want sleeping", s)
	}
	// R-SES-2: the blocks of generated tokens are published by the
	// instance's holder.
	all := append(append([]uint32{}, tokens...), want...)
	allKeys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, all)
	if len(allKeys) != 37+3 {
		t.Fatalf("%d blocks over prompt and output", len(allKeys))
	}
	w.waitPublished(t, allKeys[3:], w.url("/hi/"))
	// R-SES-1/3: the PC holds the final checkpoint of the session.
	s, _ := w.ctl.Session(w.scopeKey.ID(), pl.Session)
	if cp := s.Checkpoint; cp == nil || cp.OutputOffset != 600 || len(cp.Generated) != 600 || cp.Generated[599] != want[599] ||
		len(cp.PromptBlocks) != 3 || len(cp.PromptTail) != 3 || !cp.Sampler.Deterministic || cp.Sampler.Step != 600 {
		t.Fatalf("checkpoint at the PC: %+v", cp)
	}
}

// TestGenerateTopPReleasesAfterAck: R-SES-6: with a non-deterministic
// sampler no token reaches the front end before the PC acknowledged a
// checkpoint covering it; every index arrives once, in order.
func TestGenerateTopPReleasesAfterAck(t *testing.T) {
	w := newRig(t, rigOptions{})
	w.runAgents(t, "/ii1/")
	tokens := prompt(2)
	sampler := &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 3}
	pl, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 100, Sampler: sampler})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	err = w.front.Instance(pl.Instance).Generate(context.Background(), &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, Grant: pl.Grant, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 100, Sampler: sampler}, func(tok kvsp.GeneratedToken) error {
		s, _ := w.ctl.Session(w.scopeKey.ID(), pl.Session)
		if s.Checkpoint == nil || tok.Index >= s.Checkpoint.OutputOffset {
			t.Errorf("token %d released before a checkpoint covered it", tok.Index)
		}
		if tok.Index != uint64(n) {
			t.Errorf("index %d, want %d", tok.Index, n)
		}
		n++
		return nil
	})
	if err != nil || n != 100 {
		t.Fatalf("%d tokens, %v", n, err)
	}
	if s, _ := w.ctl.Session(w.scopeKey.ID(), pl.Session); s.Checkpoint.Sampler.Deterministic || s.Checkpoint.Sampler.Seed != 3 || s.Checkpoint.Sampler.Method != "top-p" {
		t.Fatalf("sampler in the checkpoint: %+v", s.Checkpoint.Sampler)
	}
}

// TestGreedyOnNondeterministicEngineHeldForAck (issue 20): a greedy
// session is deterministic only on a batch-invariant engine. On one that
// says it is not (llama.cpp), the agent holds every greedy token until
// the PC acknowledged a checkpoint covering it, and the checkpoint says
// deterministic: false.
func TestGreedyOnNondeterministicEngineHeldForAck(t *testing.T) {
	w := newRig(t, rigOptions{nondeterministic: true})
	w.runAgents(t, "/ii1/")
	tokens := prompt(2)
	pl, err := w.front.Controller(w.url("/pc/")).Place(context.Background(), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: tokens, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	err = w.front.Instance(pl.Instance).Generate(context.Background(), &kvsp.GenerateRequest{Session: pl.Session, Epoch: pl.Epoch, Grant: pl.Grant, ScopeID: w.scopeKey.ID(),
		CompatID: w.compat, Tokens: tokens, MaxTokens: 100}, func(tok kvsp.GeneratedToken) error {
		s, _ := w.ctl.Session(w.scopeKey.ID(), pl.Session)
		if s.Checkpoint == nil || tok.Index >= s.Checkpoint.OutputOffset {
			t.Errorf("greedy token %d released before a checkpoint covered it", tok.Index)
		}
		n++
		return nil
	})
	if err != nil || n != 100 {
		t.Fatalf("%d tokens, %v", n, err)
	}
	if s, _ := w.ctl.Session(w.scopeKey.ID(), pl.Session); s.Checkpoint.Sampler.Deterministic || s.Checkpoint.Sampler.Method != "greedy" {
		t.Fatalf("sampler in the checkpoint: %+v", s.Checkpoint.Sampler)
	}
}

// TestF4_AgentFallsBackFromACutSource (RELIABILITY F4, the agent's half;
// R-IS-10): a source whose stream is cut half-way through a block (a
// holder killed mid-GET) leaves nothing of that block in the engine; the
// next source serves it, verified.
func TestF4_AgentFallsBackFromACutSource(t *testing.T) {
	bad := &badHolder{hang: map[string]bool{}, cut: map[string][]byte{}, gets: make(chan string, 64)}
	w := newRig(t, rigOptions{extra: bad.mount})
	bad.w = w
	tokens := prompt(2)
	keys := w.fill(t, tokens, 2)
	w.claim(t, tokens, keys, 0, 1)
	for i := 0; i < 2; i++ {
		body, _ := w.blockBytes(t, tokens, i)
		bad.cut[keys[i].String()] = body
	}
	d := w.directive(keys[:2], func(int) []string { return []string{w.url("/bad/"), w.url("/h1/")} }, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchComplete || len(bad.gets) != 2 {
		t.Fatalf("status %+v, %d GETs at the cut source", st, len(bad.gets))
	}
	k, v := make([]byte, w.g.RawSectionLen()), make([]byte, w.g.RawSectionLen())
	wk, wv := make([]byte, len(k)), make([]byte, len(v))
	for i, h := range keys[:2] {
		for l := uint32(0); l < w.g.Layers; l++ {
			w.eng.KV().ReadLayer(keys[i], l, k, v)
			sim.BlockContent(w.g, h, l, wk, wv)
			if !bytes.Equal(k, wk) || !bytes.Equal(v, wv) {
				t.Fatalf("block %d layer %d", i, l)
			}
		}
	}
	// With the cut source alone the block fails and is not resident.
	w.eng.KV().Drop(keys[0])
	d = w.directive(keys[:1], func(int) []string { return []string{w.url("/bad/")} }, 5000)
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	if st := w.wait(t, d.Directive); st.State != kvsp.PrefetchFailed || w.eng.KV().Has(keys[0]) {
		t.Fatalf("cut source alone: %+v, resident %v", st, w.eng.KV().Has(keys[0]))
	}
}

// TestSessionSurvivesItsInstance: R-SES-1..16 end to end: a session runs
// on ii1, which dies mid-generation (its stream cut, its status gone);
// the PC detects it, raises the epoch and resumes the session on ii2 from
// its last checkpoint (prompt blocks loaded from the holders); the front
// end's library delivers every index exactly once, and the output equals
// an uninterrupted run.
func TestSessionSurvivesItsInstance(t *testing.T) {
	for _, sampler := range []*kvsp.PlaceSampler{nil, {Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 5}} {
		name := "greedy"
		if sampler != nil {
			name = "top-p"
		}
		t.Run(name, func(t *testing.T) { sessionSurvives(t, sampler) })
	}
}

// sessionSurvives runs the scenario with a sampler: greedy is
// deterministic (tokens released at once, regenerated identically); top-p
// is not (tokens released only once checkpointed).
func sessionSurvives(t *testing.T, sampler *kvsp.PlaceSampler) {
	w := newRig(t, rigOptions{second: true})
	w.runAgents(t, "/ii1/", "/ii2/")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { w.ctl.Run(ctx, 20*time.Millisecond); close(done) }()
	defer func() { cancel(); <-done }()
	tokens := prompt(3)
	w.fill(t, tokens, 3) // cached at h1: ii1 and ii2 both have links, ii1 wins the tie by name
	const n = 1500
	var got []uint32
	killed := false
	res, err := w.front.RunSession(context.Background(), w.front.Controller(w.url("/pc/")), &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat,
		Tokens: tokens, MaxTokens: n, Sampler: sampler}, 50*time.Millisecond, func(i uint64, tok uint32) error {
		if i != uint64(len(got)) {
			t.Fatalf("index %d delivered after %d tokens", i, len(got))
		}
		got = append(got, tok)
		if i == 300 && !killed {
			killed = true
			go w.agent.Close() // ii1 dies
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	keys, _ := kvsp.BlockKeys(w.scopeKey, w.compat, 16, tokens)
	cold, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: 5000})
	es := engine.Sampler{Method: engine.Greedy}
	if sampler != nil {
		es = engine.Sampler{Method: engine.TopP, P: 0.9, Seed: sampler.Seed}
	}
	want := tokensOf(t, cold, engine.Request{Tokens: tokens, Keys: keys, MaxTokens: n, Sampler: es})
	if !equal(got, want) {
		t.Fatalf("delivered %d tokens; differs from the uninterrupted run", len(got))
	}
	if res.Finish != kvsp.FinishLength {
		t.Fatalf("finish: %q at the front end", res.Finish)
	}
	s := waitFinished(t, w, res.Session, kvsp.FinishLength)
	if s.Epoch != 2 || s.Instance != w.url("/ii2/") || s.Checkpoint == nil || s.Checkpoint.OutputOffset != n || s.Checkpoint.Epoch != 2 ||
		s.Checkpoint.Sampler.Deterministic != (sampler == nil) {
		t.Fatalf("session at the PC: epoch %d on %s, checkpoint %+v", s.Epoch, s.Instance, s.Checkpoint)
	}
}
