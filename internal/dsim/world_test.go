// Package dsim_test is the deterministic simulation of a KVSP deployment
// (RELIABILITY DS1, F10): an IS, a PC, holders and instances on simulated
// engines, each with its real handlers behind its own host of an
// in-memory fabric (internal/simnet), talking through the real clients
// with their mutual-TLS identities, all inside one testing/synctest
// bubble, so TTLs, leases, deadlines and sweeps run on the bubble's fake
// clock. A seeded plan crashes and restarts processes and drops and delays
// messages; the invariants are checked on what the front ends receive and
// what the components hold. A failing seed is printed: it replays the same
// faults at the same instants of the fake clock (one goroutine draws
// them); which message a drop hits within an instant follows the Go
// scheduler's interleaving, so a replay is close, not bit-exact.
package dsim_test

import (
	"context"
	"crypto/x509"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/internal/pki"
	"github.com/kvsp/kvsp/internal/simnet"
	"github.com/kvsp/kvsp/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	agentID   = "spiffe://kvsp.test/ii"
	blockToks = 16
	isBase    = "https://is.sim/"
	pcBase    = "https://pc.sim/"
)

var desc = func() kvsp.Descriptor {
	d, err := kvsp.ParseDescriptor([]byte(`{"model": "sim/dsim", "tokenizer_digest": "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
  "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
  "layers": 2, "kv_heads": 1, "head_dim": 8, "kv_dtype": "bf16", "positional": "rope", "block_tokens": 16, "layout": "kvsp-layout-1"}`))
	if err != nil {
		panic(err)
	}
	return d
}()

// seeds is the number of seeds a simulation test runs: env (make sim
// SEEDS=1000) or def.
func seeds(env string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(env)); err == nil && n > 0 {
		return n
	}
	return def
}

// firstSeed lets a failing seed be replayed alone: KVSP_SIM_SEED.
func seedList(env string, def int) []uint64 {
	if s := os.Getenv("KVSP_SIM_SEED"); s != "" {
		v, _ := strconv.ParseUint(s, 10, 64)
		return []uint64{v}
	}
	n := seeds(env, def)
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i + 1)
	}
	return out
}

// watchdog fails the run, with every goroutine's stack, if a seed takes
// longer than limit of real time: a goroutine blocked on something the
// bubble cannot see (a mutex held across a wait on the fake clock) stops
// the fake clock, and the run would hang instead of failing.
func watchdog(seed uint64, limit time.Duration) (stop func()) {
	timer := time.AfterFunc(limit, func() {
		fmt.Fprintf(os.Stderr, "dsim: seed %d still running after %v of real time: the fake clock is stuck; goroutines:\n", seed, limit)
		pprof.Lookup("goroutine").WriteTo(os.Stderr, 2)
		panic(fmt.Sprintf("dsim: seed %d stuck (KVSP_SIM_SEED=%d replays it)", seed, seed))
	})
	return func() { timer.Stop() }
}

// ids are the identities of the simulation, made once (outside bubbles).
type ids struct {
	creds    *mtls.Credentials
	policy   string
	dir      string
	certs    map[string]*x509.Certificate
	tls      map[string]*pki.Leaf
	pkiFiles *kvsptest.PKI
}

func identities(t *testing.T, holders, instances int) *ids {
	p := kvsptest.NewPKI(t)
	p.WriteLeaf("server.pem", "server.key", p.Issue(pki.LeafOptions{URIs: []string{"spiffe://kvsp.test/server"}}))
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: p.Path("server.pem"), Key: p.Path("server.key"), ClientCA: p.Path("ca.pem")}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var hs, is []string
	for i := 1; i <= holders; i++ {
		hs = append(hs, fmt.Sprintf(`"https://h%d.sim/"`, i))
	}
	for i := 1; i <= instances; i++ {
		is = append(is, fmt.Sprintf(`"https://ii%d.sim/"`, i))
	}
	pol := `principals:
  - {id: "` + kvsptest.PC + `", roles: [controller], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + kvsptest.Holder1 + `", roles: [holder], speaks_for: [` + strings.Join(hs, ", ") + `], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + kvsptest.ClientA + `", roles: [client], scopes: [` + kvsptest.Scope + `]}
  - {id: "` + agentID + `", roles: [instance, client], speaks_for: [` + strings.Join(is, ", ") + `], scopes: [` + kvsptest.Scope + `]}
`
	x := &ids{creds: creds, policy: pol, dir: p.Dir, certs: map[string]*x509.Certificate{}, tls: map[string]*pki.Leaf{}, pkiFiles: p}
	for _, id := range []string{kvsptest.PC, kvsptest.Holder1, kvsptest.ClientA, agentID} {
		l := p.Leaf(id)
		x.tls[id], x.certs[id] = l, l.Cert
	}
	return x
}

// world is one simulated deployment inside a bubble.
type world struct {
	t      *testing.T
	rng    *rand.Rand
	net    *simnet.Fabric
	ids    *ids
	pol    *server.PolicyStore
	scope  kvsp.ScopeKey
	compat kvsp.CompatID
	g      container.Geometry
	ctx    context.Context
	cancel context.CancelFunc
	closes []func()
	mu     sync.Mutex // agents

	mem   *index.Memory
	pc    *placement.Controller
	pcRun context.CancelFunc
	pcWG  sync.WaitGroup

	holders []*proc
	insts   []*proc
	agents  map[string]*instance.Agent // the running incarnation of each instance, by base
	// instRegs are the metrics registries of every instance incarnation.
	instRegs []*prometheus.Registry
	// skew steps the wall clock of a restarting instance back (its epoch
	// clock): the persisted counter must keep its epoch increasing.
	skew  time.Duration
	front *client.Client
	// epochFiles keep the instances' epochs across restarts (R-ST-5).
	dir string
}

// proc is a component that can crash and restart.
type proc struct {
	host  string
	base  string
	stop  func() // its crash: off the network, its objects torn down
	start func()
	up    bool
	n     int                 // incarnations
	links []*simnet.Transport // its outgoing side, cut when it crashes
}

type options struct {
	holders, instances int
	decode             float64
	// durablePC keeps the PC's state in a bbolt file, so it can crash and
	// restart with its epochs and checkpoints.
	durablePC bool
}

// client is a client of one process with identity id; its transport is
// added to p's, cut when p crashes (nil: the front end, which never does).
func (w *world) client(id string, p *proc) *client.Client {
	tr := w.net.Transport(w.ids.certs[id])
	c, err := client.New(client.Config{TLS: w.ids.pkiFiles.ClientTLS(w.ids.tls[id]), Transport: tr, Attempts: 2, Timeout: 2 * time.Second})
	if err != nil {
		w.t.Fatal(err)
	}
	w.closes = append(w.closes, c.Close)
	if p != nil {
		p.links = append(p.links, tr)
	}
	return c
}

// newServer is a process's HTTPS server (its routes, the policy, the
// server certificate), reached through the fabric.
func (w *world) newServer(mount func(*server.Server)) *server.Server {
	s, err := server.New(server.Config{Credentials: w.ids.creds, Policy: w.pol, Logger: simLog("http")})
	if err != nil {
		w.t.Fatal(err)
	}
	mount(s)
	return s
}

// simLog is the components' logger: KVSP_SIM_LOG=1 prints them (to
// replay a failing seed), otherwise nothing.
func simLog(name string) *slog.Logger {
	if os.Getenv("KVSP_SIM_LOG") == "" {
		return slog.New(slog.DiscardHandler)
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("c", name)
}

func newWorld(t *testing.T, x *ids, seed uint64, o options) *world {
	w := &world{t: t, rng: rand.New(rand.NewPCG(seed, 0xd5)), net: simnet.New(seed), ids: x, dir: t.TempDir(), agents: map[string]*instance.Agent{}}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	pol, err := server.ParsePolicy([]byte(x.policy))
	if err != nil {
		t.Fatal(err)
	}
	w.pol = server.NewStaticPolicyStore(pol)
	key := make([]byte, 32)
	for i := range key {
		key[i] = byte(i)
	}
	w.scope, _ = kvsp.NewScopeKey(key)
	w.compat, _ = desc.CompatID()
	// The IS.
	w.mem = index.NewMemory(time.Second)
	svc, _ := index.New(index.Config{MaxTTL: time.Minute, MaxLookupKeys: 4096}, w.mem)
	w.net.Up("is.sim", w.newServer(func(s *server.Server) { svc.Mount(s.Mount("/")) }).Handler())
	// Holders: host memory only, so a crash loses everything (F7).
	for i := 1; i <= o.holders; i++ {
		p := &proc{host: fmt.Sprintf("h%d.sim", i), base: fmt.Sprintf("https://h%d.sim/", i)}
		var h *holder.Holder
		p.start = func() {
			eng, err := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 1, DecodeTokensPerS: 1}) // for its geometry
			if err != nil {
				t.Fatal(err)
			}
			g := eng.Geometry()
			w.g = g
			h, err = holder.New(holder.Config{Base: p.base, Geometries: map[kvsp.CompatID]container.Geometry{w.compat: g}, Capacity: 64 << 20,
				ReadMbitPerS: 100000, Index: w.client(kvsptest.Holder1, p).Index(isBase), RecordTTL: 10 * time.Second,
				LeaseQuota: holder.LeaseQuota{Octets: 64 << 20, MaxTTL: 10 * time.Second, MaxLeases: 1024}})
			if err != nil {
				t.Fatal(err)
			}
			w.net.Up(p.host, w.newServer(func(s *server.Server) { h.Mount(s.Mount("/")) }).Handler())
		}
		p.stop = func() {
			w.net.Down(p.host)
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // a crash: nothing is withdrawn in an orderly way
			h.Close(ctx)
		}
		w.holders = append(w.holders, p)
	}
	// The PC, its state in a bbolt file so a crash keeps epochs and
	// checkpoints.
	var store *placement.BoltStore
	pcProc := &proc{host: "pc.sim", base: pcBase}
	pcProc.start = func() {
		pcc := w.client(kvsptest.PC, pcProc)
		cfg := placement.Config{Scopes: []kvsp.ScopeKey{w.scope}, BlockTokens: map[kvsp.CompatID]int{w.compat: blockToks},
			Index: pcc.Index(isBase), Instances: placement.ClientInstances{C: pcc}, RestartGrace: 3 * time.Second, Logger: simLog("pc")}
		var err error
		if o.durablePC {
			if store, err = placement.OpenBoltStore(filepath.Join(w.dir, "pc.db")); err != nil {
				t.Fatal(err)
			}
			cfg.State = store
		}
		w.pc, err = placement.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		w.net.Up("pc.sim", w.newServer(func(s *server.Server) { w.pc.Mount(s.Mount("/")) }).Handler())
		ctx, cancel := context.WithCancel(w.ctx)
		w.pcRun = cancel
		pc := w.pc
		w.pcWG.Go(func() { pc.Run(ctx, 250*time.Millisecond) })
	}
	pcProc.stop = func() {
		w.net.Down("pc.sim")
		w.pcRun()
		w.pcWG.Wait()
		if store != nil {
			store.Close()
		}
	}
	// Instances.
	for i := 1; i <= o.instances; i++ {
		p := &proc{host: fmt.Sprintf("ii%d.sim", i), base: fmt.Sprintf("https://ii%d.sim/", i)}
		var (
			a    *instance.Agent
			stop context.CancelFunc
			wg   sync.WaitGroup
		)
		holderBase := w.holders[(i-1)%len(w.holders)].base
		p.start = func() {
			eng, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 42000, DecodeTokensPerS: o.decode, BatchSize: 8, KVBlocks: 512})
			var links []kvsp.Link
			for _, h := range w.holders {
				links = append(links, kvsp.Link{Holder: h.base, MbitPerS: 100000, RTTUs: 20})
			}
			reg := prometheus.NewRegistry()
			w.instRegs = append(w.instRegs, reg)
			skew := w.skew
			var err error
			a, err = instance.New(instance.Config{Base: p.base, Engine: eng, Client: w.client(agentID, p), Controller: pcBase, Index: isBase, Holder: holderBase,
				Scopes: []kvsp.ScopeKey{w.scope}, StatusTTL: time.Second, Links: links, EpochFile: filepath.Join(w.dir, p.host+".epoch"), Logger: simLog(p.host),
				Registerer: reg, Now: func() time.Time { return time.Now().Add(-skew) }})
			if err != nil {
				t.Fatal(err)
			}
			w.net.Up(p.host, w.newServer(func(s *server.Server) { a.Mount(s.Mount("/")) }).Handler())
			w.mu.Lock()
			w.agents[p.base] = a
			w.mu.Unlock()
			var ctx context.Context
			ctx, stop = context.WithCancel(w.ctx)
			wg.Go(func() { a.Run(ctx) })
		}
		p.stop = func() {
			w.net.Down(p.host)
			stop()
			a.Close()
			wg.Wait()
			w.mu.Lock()
			delete(w.agents, p.base)
			w.mu.Unlock()
		}
		w.insts = append(w.insts, p)
	}
	for _, p := range append(append([]*proc{pcProc}, w.holders...), w.insts...) {
		p.start()
		p.up, p.n = true, 1
	}
	w.holders = append(w.holders, pcProc) // crashed like the others; kept last
	w.front = w.client(kvsptest.ClientA, nil)
	// Every instance has reported.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		n := 0
		for _, p := range w.insts {
			if s, ok := w.pc.Registry().Get(p.base); ok && s.State == kvsp.StateActive {
				n++
			}
		}
		if n == len(w.insts) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the instances never reported")
		}
	}
	return w
}

// pcUp reports the PC's process up (it is the last of w.holders).
func (w *world) pcUp() bool { return w.holders[len(w.holders)-1].up }

// crash takes p down; restart brings it back (a new incarnation).
func (w *world) crash(p *proc) {
	if p.up {
		for _, l := range p.links { // a dead process sends nothing more
			l.Close()
		}
		p.links = nil
		p.stop()
		p.up = false
	}
}

func (w *world) restart(p *proc) {
	if !p.up {
		p.start()
		p.up = true
		p.n++
	}
}

// close ends the world: every component stopped, every goroutine gone.
func (w *world) close() {
	for _, p := range append(w.insts, w.holders...) {
		w.crash(p)
	}
	w.cancel()
	w.mem.Close()
	for _, c := range w.closes {
		c()
	}
}

// uninterrupted is the output of q on an engine that never fails.
func (w *world) uninterrupted(q *kvsp.PlaceRequest) []uint32 {
	eng, _ := sim.New(sim.Config{Descriptor: desc, PrefillTokensPerS: 1e9, DecodeTokensPerS: 1e9})
	keys, _ := kvsp.BlockKeys(w.scope, w.compat, blockToks, q.Tokens)
	s := engine.Sampler{Method: engine.Greedy}
	if ps := q.Sampler; ps != nil {
		s = engine.Sampler{Method: ps.Method, P: ps.Params["p"].(float64), Seed: ps.Seed}
	}
	var want []uint32
	eng.Generate(context.Background(), engine.Request{Tokens: q.Tokens, Keys: keys, MaxTokens: int(q.MaxTokens), Sampler: s},
		func(tk engine.Token) error { want = append(want, tk.ID); return nil })
	return want
}

func promptTokens(k, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(13*i + 1 + 1000*k)
	}
	return out
}
