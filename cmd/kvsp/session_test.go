package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/engine"
	"github.com/kvsp/kvsp/engine/sim"
)

const tinyDescriptor = `{"model": "sim/tiny", "tokenizer_digest": "sha-256:9f42a7a29dca3063ad26d7be7fe6a930fa38afb1a703e4f7ff538db4e133b19c",
  "model_digest": "sha-256:254e528c669a2084c9727298cacb83e8854e0a6ff80e2bf18096b9dce0f7ebda",
  "layers": 4, "kv_heads": 2, "head_dim": 16, "kv_dtype": "bf16", "positional": "rope", "block_tokens": 16, "layout": "kvsp-layout-1"}`

// TestSessionSurvivesSIGKILL (issue 8, with real processes): the IS, the
// PC and a holder in one `kvsp serve` process, two instances in two more;
// the instance serving a session is SIGKILLed mid-generation; the PC
// detects it by its status TTL, migrates the session, and the front-end
// library delivers every index once: the output equals an uninterrupted
// run of the same engine.
func TestSessionSurvivesSIGKILL(t *testing.T) {
	c := startSessionCluster(t, nil)
	var got []uint32
	killed := false
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := c.front.RunSession(ctx, c.pc, c.q, 100*time.Millisecond, func(i uint64, tok uint32) error {
		got = append(got, tok)
		if i == 400 && !killed {
			killed = true
			c.p1.kill() // SIGKILL the serving instance
		}
		return nil
	})
	if err != nil || !killed {
		t.Fatalf("session: %d tokens, killed %v, %v", len(got), killed, err)
	}
	if want := c.uninterrupted(); !slices.Equal(got, want) {
		t.Fatalf("delivered %d tokens; not the uninterrupted output (%d)", len(got), len(want))
	}
}

// TestPCRestartMidSession (issue 8): the PC, in a process of its own with
// a bbolt state file, is SIGKILLed while a top-p session runs and started
// again: the session's epoch has not gone backwards, its checkpoints are
// accepted again, and the front end gets one consistent output.
func TestPCRestartMidSession(t *testing.T) {
	c := startSessionClusterWith(t, &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 8}, true)
	var got []uint32
	restarted := false
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	_, err := c.front.RunSession(ctx, c.pc, c.q, 100*time.Millisecond, func(i uint64, tok uint32) error {
		got = append(got, tok)
		if i == 300 && !restarted {
			restarted = true
			c.restartPC(t)
		}
		return nil
	})
	if err != nil || !restarted {
		t.Fatalf("session: %d tokens, %v", len(got), err)
	}
	if want := c.uninterrupted(); !slices.Equal(got, want) {
		t.Fatalf("delivered %d tokens; not one consistent output (%d)", len(got), len(want))
	}
	q := *c.q
	if out, err := c.front.Controller(c.pc).Place(ctx, &q); err != nil || out.Epoch < 1 || out.Session != c.session {
		t.Fatalf("the session after the restart: %+v %v", out, err)
	}
}

// TestPartitionedInstanceCannotExtendItsSession (issue 8): the instance
// serving a top-p session is SIGSTOPped; once its status expires the PC
// moves the session to the other instance at a higher epoch; when the
// first one is SIGCONTed its checkpoints carry the old epoch and are
// refused, so it releases no further token (R-SES-6, R-SES-15); the front
// end gets one consistent output, equal to an uninterrupted run.
func TestPartitionedInstanceCannotExtendItsSession(t *testing.T) {
	c := startSessionCluster(t, &kvsp.PlaceSampler{Method: "top-p", Params: map[string]any{"p": 0.9}, Seed: 4})
	var got []uint32
	stopped := make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	go func() {
		<-stopped
		// Until the PC has moved the session, place answers b1.
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) {
			q := *c.q
			q.Session = &c.session
			if out, err := c.front.Controller(c.pc).Place(ctx, &q); err == nil && out.Epoch == 2 && out.Instance == c.b2 {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		c.p1.cmd.Process.Signal(syscall.SIGCONT)
	}()
	paused := false
	session, err := c.front.RunSession(ctx, c.pc, c.q, 100*time.Millisecond, func(i uint64, tok uint32) error {
		got = append(got, tok)
		if i == 200 && !paused {
			paused = true
			c.p1.cmd.Process.Signal(syscall.SIGSTOP)
			close(stopped)
		}
		return nil
	})
	if err != nil || !paused {
		t.Fatalf("session: %d tokens, %v", len(got), err)
	}
	if session != c.session {
		t.Fatal("another session")
	}
	if want := c.uninterrupted(); !slices.Equal(got, want) {
		t.Fatalf("delivered %d tokens; not one consistent output (%d)", len(got), len(want))
	}
}

// sessionCluster is the IS, PC and holder in one kvsp serve process and
// two instance processes (b1 is placed first), with a front end.
type sessionCluster struct {
	pcCfg, pcAddr string
	pcProc        *proc
	front         *client.Client
	pc, b2        string
	p1            *proc
	q             *kvsp.PlaceRequest
	session       kvsp.UUID
	d             kvsp.Descriptor
	sk            kvsp.ScopeKey
}

// restartPC kills the PC's process with SIGKILL and starts it again on
// the same state file.
func (c *sessionCluster) restartPC(t *testing.T) {
	c.pcProc.kill()
	c.pcProc = startServe(t, c.pcCfg, c.pcAddr)
}

func (c *sessionCluster) uninterrupted() []uint32 {
	eng, _ := sim.New(sim.Config{Descriptor: c.d, PrefillTokensPerS: 1e9, DecodeTokensPerS: 1e9})
	compat, _ := c.d.CompatID()
	keys, _ := kvsp.BlockKeys(c.sk, compat, 16, c.q.Tokens)
	s := engine.Sampler{Method: engine.Greedy}
	if ps := c.q.Sampler; ps != nil {
		s = engine.Sampler{Method: ps.Method, P: ps.Params["p"].(float64), Seed: ps.Seed}
	}
	var want []uint32
	eng.Generate(context.Background(), engine.Request{Tokens: c.q.Tokens, Keys: keys, MaxTokens: int(c.q.MaxTokens), Sampler: s},
		func(tk engine.Token) error { want = append(want, tk.ID); return nil })
	return want
}

func startSessionCluster(t *testing.T, sampler *kvsp.PlaceSampler) *sessionCluster {
	return startSessionClusterWith(t, sampler, false)
}

// startSessionClusterWith, with separatePC, runs the PC in a process of
// its own whose state is a bbolt file (c.restartPC kills and restarts it).
func startSessionClusterWith(t *testing.T, sampler *kvsp.PlaceSampler, separatePC bool) *sessionCluster {
	dir := t.TempDir()
	free := func() string {
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		defer ln.Close()
		return ln.Addr().String()
	}
	a, b1, b2 := free(), free(), free()
	pcAddr := a
	if separatePC {
		pcAddr = free()
	}
	base := func(addr, path string) string { return "https://" + addr + path }
	if base(b2, "/ii/") < base(b1, "/ii/") { // placement breaks cost ties by URI: b1 first
		b1, b2 = b2, b1
	}
	common := `http3: false
tls: {cert: server.pem, key: server.key, client_ca: ca.pem, client_cert: self.pem, client_key: self.key}
policy: policy.yaml
scopes: [{key_file: scope-a.key}]
`
	pcRole := `controller: {base: ` + base(pcAddr, "/pc/") + `, index: ` + base(a, "/is/") + `, state: bolt, state_path: pc.db, descriptors: [descriptor.json]}
`
	roles := `index: {base: ` + base(a, "/is/") + `, max_ttl_ms: 600000, max_lookup_keys: 4096, backend: memory}
holders:
  - base: ` + base(a, "/h1/") + `
    index: ` + base(a, "/is/") + `
    descriptors: [descriptor.json]
    tiers: [{name: host, capacity: 256MiB, read_mbit_per_s: 400000}]
    lease_quota: {octets: 256MiB, max_ttl_ms: 60000, max_leases: 1024}
`
	inst := func(addr string) string {
		return `  - base: ` + base(addr, "/ii/") + `
    controller: ` + base(pcAddr, "/pc/") + `
    index: ` + base(a, "/is/") + `
    holder: ` + base(a, "/h1/") + `
    engine: {kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: 42000, decode_tokens_per_s: 3100}
`
	}
	writeFile(t, dir, "descriptor.json", tinyDescriptor)
	// One identity for the three processes (they share 127.0.0.1): the
	// union configuration makes its certificate and policy.
	all := writeFile(t, dir, "all.yaml", "listen: "+a+"\n"+common+roles+pcRole+"instances:\n"+inst(b1)+inst(b2))
	if code, _, errs := runCLI(t, "certs", "--config", all); code != 0 {
		t.Fatal(errs)
	}
	var (
		pcProc *proc
		pcCfg  string
	)
	if separatePC {
		startServe(t, writeFile(t, dir, "a.yaml", "listen: "+a+"\n"+common+roles), a)
		pcCfg = writeFile(t, dir, "pc.yaml", "listen: "+pcAddr+"\n"+common+pcRole)
		pcProc = startServe(t, pcCfg, pcAddr)
	} else {
		startServe(t, writeFile(t, dir, "a.yaml", "listen: "+a+"\n"+common+roles+pcRole), a)
	}
	p1 := startServe(t, writeFile(t, dir, "b1.yaml", "listen: "+b1+"\n"+common+"instances:\n"+inst(b1)), b1)
	startServe(t, writeFile(t, dir, "b2.yaml", "listen: "+b2+"\n"+common+"instances:\n"+inst(b2)), b2)
	t.Cleanup(func() { p1.cmd.Process.Signal(syscall.SIGCONT) }) // a stopped process cannot be killed cleanly

	pair, _ := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key"))
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	front, err := client.New(client.Config{TLS: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}}, Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(front.Close)
	keyFile, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(keyFile)
	d, _ := kvsp.ParseDescriptor([]byte(tinyDescriptor))
	compat, _ := d.CompatID()
	tokens := make([]uint32, 3*16+5)
	for i := range tokens {
		tokens[i] = uint32(13*i + 1)
	}
	q := &kvsp.PlaceRequest{ScopeID: sk.ID(), CompatID: compat, Tokens: tokens, MaxTokens: 1200, Sampler: sampler}
	// Both instances report to the PC within a status period; b1 wins the
	// cost tie. The session id is fixed, so the test can ask about it.
	c := &sessionCluster{front: front, pc: base(pcAddr, "/pc/"), b2: base(b2, "/ii/"), p1: p1, q: q, d: d, sk: sk, session: kvsp.NewUUID(),
		pcAddr: pcAddr, pcCfg: pcCfg, pcProc: pcProc}
	deadline := time.Now().Add(20 * time.Second)
	for {
		probe := *q
		probe.Session = nil
		out, err := front.Controller(c.pc).Place(context.Background(), &probe)
		if err == nil && out.Instance == base(b1, "/ii/") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the PC does not place on b1: %+v %v", out, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	q.Session = &c.session
	return c
}
