package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/quicbulk"
)

const testConfig = `listen: 127.0.0.1:0
http3: false
quicbulk: true
tls: {cert: server.pem, key: server.key, client_ca: ca.pem, client_cert: self.pem, client_key: self.key}
policy: policy.yaml
scopes: [{key_file: scope-a.key}]
index: {base: https://127.0.0.1:8443/is/, max_ttl_ms: 600000, max_lookup_keys: 4096, backend: memory, producer_digests: true}
controller: {base: https://127.0.0.1:8443/pc/, index: https://127.0.0.1:8443/is/, state: memory}
holders:
  - base: https://127.0.0.1:8443/h1/
    index: https://127.0.0.1:8443/is/
    record_ttl_ms: 60000
    descriptors: [descriptor.json]
    tiers: [{name: host, capacity: 1GiB, read_mbit_per_s: 400000}, {name: local-storage, capacity: 10GiB, path: store}]
    lease_quota: {octets: 1GiB, max_ttl_ms: 60000, max_leases: 1024}
  - base: https://127.0.0.1:8443/h2/   # no descriptors: a cache server for any model
    index: https://127.0.0.1:8443/is/
    tiers: [{name: host, capacity: 64MiB}]
instances:
  - base: https://127.0.0.1:8443/ii1/
    controller: https://127.0.0.1:8443/pc/
    index: https://127.0.0.1:8443/is/
    holder: https://127.0.0.1:8443/h1/
    engine: {kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: 42000, decode_tokens_per_s: 3100}
`

func writeFile(t *testing.T, dir, name, content string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestCertsEngine: --engine issues an identity for an engine outside kvsp
// (a vLLM connector): producer and client in every scope, no role hosted;
// a name that is no file name nor URI segment is refused.
func TestCertsEngine(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "kvsp.yaml", testConfig)
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	if code, out, errs := runCLI(t, "certs", "--config", cfg, "--engine", "vllm"); code != 0 || !strings.Contains(out, "vllm.pem for spiffe://kvsp.local/engine/vllm (roles producer, client)") {
		t.Fatalf("certs --engine: %d %s %s", code, out, errs)
	}
	for _, f := range []string{"vllm.pem", "vllm.key"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("certs --engine did not write %s", f)
		}
	}
	pol, _ := os.ReadFile(filepath.Join(dir, "policy.yaml"))
	key, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(key)
	if want := "- id: spiffe://kvsp.local/engine/vllm\n    roles: [producer, client]\n    scopes: [" + sk.ID().String() + "]"; !strings.Contains(string(pol), want) {
		t.Fatalf("policy lacks the engine:\n%s", pol)
	}
	for _, bad := range []string{"", "../x", "Vllm", "a/b"} {
		if code, _, _ := runCLI(t, "certs", "--config", cfg, "--engine", bad); code == 0 {
			t.Errorf("--engine %q accepted", bad)
		}
	}
}

// TestCertsPerRole: --per-role issues one identity per role, that role
// alone, every scope; the holder and instance identities speak for the
// configuration's holders and instances, and no other does (the API
// contract's tests call each operation as the role x-kvsp-roles names).
func TestCertsPerRole(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "kvsp.yaml", testConfig)
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	if code, out, errs := runCLI(t, "certs", "--config", cfg, "--per-role"); code != 0 || !strings.Contains(out, "role-producer.pem for spiffe://kvsp.local/role/producer (role producer)") {
		t.Fatalf("certs --per-role: %d %s %s", code, out, errs)
	}
	pol, _ := os.ReadFile(filepath.Join(dir, "policy.yaml"))
	key, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(key)
	for role, speaks := range map[string]string{"controller": "", "index": "", "holder": "https://127.0.0.1:8443/h1/', 'https://127.0.0.1:8443/h2/", "instance": "https://127.0.0.1:8443/ii1/", "client": "", "producer": ""} {
		if _, err := os.Stat(filepath.Join(dir, "role-"+role+".key")); err != nil {
			t.Errorf("no key for %s", role)
		}
		want := "- id: spiffe://kvsp.local/role/" + role + "\n    roles: [" + role + "]\n"
		if speaks != "" {
			want += "    speaks_for: ['" + speaks + "']\n"
		}
		want += "    scopes: [" + sk.ID().String() + "]"
		if !strings.Contains(string(pol), want) {
			t.Errorf("policy lacks %q:\n%s", want, pol)
		}
	}
}

// TestCertsThenServe: the README's flow. `kvsp certs` writes what the
// configuration names; `kvsp serve` then serves its roles behind mutual
// TLS, and stops cleanly when told.
func TestCertsThenServe(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "kvsp.yaml", testConfig)
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	code, out, errs := runCLI(t, "certs", "--config", cfg)
	if code != 0 {
		t.Fatalf("certs: %d %s %s", code, out, errs)
	}
	for _, f := range []string{"ca.pem", "ca.key", "server.pem", "server.key", "self.pem", "self.key", "client.pem", "client.key", "policy.yaml", "scope-a.key"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("certs did not write %s", f)
		}
	}
	pol, _ := os.ReadFile(filepath.Join(dir, "policy.yaml"))
	for _, want := range []string{"controller", "index", "holder", "instance", "https://127.0.0.1:8443/h1/", "https://127.0.0.1:8443/ii1/", "spiffe://kvsp.local/client/tool"} {
		if !strings.Contains(string(pol), want) {
			t.Errorf("policy lacks %q:\n%s", want, pol)
		}
	}
	// A second run reuses the CA and the scope key.
	ca1, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	key1, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	if code, _, errs := runCLI(t, "certs", "--config", cfg); code != 0 {
		t.Fatalf("certs again: %s", errs)
	}
	ca2, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	key2, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	if !bytes.Equal(ca1, ca2) || !bytes.Equal(key1, key2) {
		t.Fatal("certs replaced the CA or a scope key")
	}

	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	done := make(chan error, 1)
	var logs bytes.Buffer
	go func() { done <- serve(ctx, []string{"--config", cfg}, &logs, nil, ready) }()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("serve: %v", err)
	}
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca1)
	tr := &http.Transport{TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get("https://" + addr + "/pc/no-such-resource")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 || resp.Header.Get("Content-Type") != kvsp.MediaTypeProblem || resp.Header.Get("Cache-Control") != "no-store" || resp.Proto != "HTTP/2.0" {
		t.Fatalf("authenticated request: %s %d %q %s", resp.Proto, resp.StatusCode, resp.Header.Get("Content-Type"), body)
	}
	noCert := &http.Transport{TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots}}
	defer noCert.CloseIdleConnections()
	if _, err := (&http.Client{Transport: noCert, Timeout: 5 * time.Second}).Get("https://" + addr + "/is/lookup"); err == nil {
		t.Fatal("served a client without a certificate")
	}
	// The index answers lookups in the process's scope (the tool client's
	// principal carries it).
	sk, _ := kvsp.ScopeKeyFromFile(key1)
	lk := `{"scope_id":"` + sk.ID().String() + `","compat_id":"` + strings.Repeat("ab", 32) + `","block_keys":["` + strings.Repeat("cd", 32) + `"]}`
	resp, err = (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Post("https://"+addr+"/is/lookup", kvsp.MediaType, strings.NewReader(lk))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != `{"matched":0,"replicas":[]}` {
		t.Fatalf("lookup through kvsp serve: %d %s", resp.StatusCode, body)
	}
	// index.producer_digests reaches the IS: h1 (the process's identity
	// speaks for it) publishing a key no producer stated, or another
	// digest than its producer's (ii1, which the process's identity also
	// speaks for), is refused (R-SEC-8, S8, S13).
	self, err := tls.LoadX509KeyPair(filepath.Join(dir, "self.pem"), filepath.Join(dir, "self.key"))
	if err != nil {
		t.Fatal(err)
	}
	selfTLS := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{self}}
	sc, _ := client.New(client.Config{TLS: selfTLS})
	defer sc.Close()
	layers := []container.Digest{{1}}
	rec := &kvsp.ReplicaRecord{BlockKey: kvsp.BlockKey{0xcd}, CompatID: kvsp.CompatID{0xab}, ScopeID: sk.ID(), Holder: "https://127.0.0.1:8443/h1/", Codec: 1,
		Size: 1, Digest: kvsp.Digest(container.ReplicaDigest(layers)), LayerDigests: []kvsp.LayerDigest{kvsp.LayerDigest(layers[0])}, TTLMs: 60000,
		Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 0}}}}
	is := sc.Index("https://" + addr + "/is/")
	if _, _, err := is.Publish(context.Background(), rec); !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("a record no producer stated a digest for: %v, want 409", err)
	}
	if _, err := is.StateDigest(context.Background(), &kvsp.ProducerRecord{BlockKey: rec.BlockKey, CompatID: rec.CompatID, ScopeID: rec.ScopeID,
		Producer: "https://127.0.0.1:8443/ii1/", Digest: rec.Digest, TTLMs: 60000}); err != nil {
		t.Fatalf("ii1 states its digest: %v", err)
	}
	if _, _, err := is.Publish(context.Background(), rec); err != nil {
		t.Fatalf("publish: %v", err)
	}
	other := *rec
	other.Digest, other.LayerDigests = kvsp.Digest{2}, nil
	if _, _, err := is.Publish(context.Background(), &other); !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("another digest for the key with producer_digests: %v, want 409", err)
	}
	// The holder stores and serves a block of the configured descriptor.
	g := container.Geometry{Layers: 32, BlockTokens: 4, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	h, _ := container.NewHeader(container.CodecRaw, 0, 32, g)
	var blk bytes.Buffer
	w := container.NewWriter(&blk, h)
	for i := 0; i < 32; i++ {
		w.WriteLayer(make([]byte, 8192), make([]byte, 8192))
	}
	w.Close()
	bpath := "https://" + addr + "/h1/blocks/5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f/" + sk.ID().String() + "/" + strings.Repeat("ef", 32)
	hc := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	// Stored by the process's identity (an instance: a producer of KV);
	// the tool client, a client only, may not store blocks (S13).
	hp := &http.Client{Transport: &http.Transport{TLSClientConfig: selfTLS}, Timeout: 5 * time.Second}
	defer hp.CloseIdleConnections()
	for who, c := range map[int]*http.Client{403: hc, 201: hp} {
		req, _ := http.NewRequest("PUT", bpath, bytes.NewReader(blk.Bytes()))
		req.Header.Set("If-None-Match", "*")
		req.Header.Set("Content-Type", "application/kvsp-block")
		resp, err = c.Do(req)
		if err != nil || resp.StatusCode != who {
			t.Fatalf("PUT block through kvsp serve: %v %v, want %d", resp, err, who)
		}
		resp.Body.Close()
	}
	resp, err = hc.Get(bpath + "?layers=0-1")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || len(body) != 52+4*8192 || resp.Header.Get("Repr-Digest") != "sha-256=:+Yrl5A1vrxQNHQQbj8CsCJfygT5Vy3mGgpr26nPIRF8=:" {
		t.Fatalf("GET layers=0-1: %d %d %q", resp.StatusCode, len(body), resp.Header.Get("Repr-Digest"))
	}
	// h2 has no descriptors: it stores a model no descriptor names; h1,
	// which has them, refuses it (issue 19 item 11).
	hdr := container.Header{Codec: container.CodecRaw, TokenCount: 2, Layers: []container.LayerLen{{K: 16, V: 16}}}
	anyBlock := append(hdr.Append(nil), make([]byte, 32)...)
	for base, want := range map[string]int{"h2": 201, "h1": 409} {
		req, _ := http.NewRequest("PUT", "https://"+addr+"/"+base+"/blocks/"+strings.Repeat("77", 32)+"/"+sk.ID().String()+"/"+strings.Repeat("ef", 32), bytes.NewReader(anyBlock))
		req.Header.Set("If-None-Match", "*")
		req.Header.Set("Content-Type", "application/kvsp-block")
		resp, err := hp.Do(req)
		if err != nil || resp.StatusCode != want {
			t.Fatalf("PUT a block of another model at %s: %v %v, want %d", base, resp, err, want)
		}
		resp.Body.Close()
	}
	// The same GET over the quicbulk path, on the UDP port.
	bulk := &quicbulk.Transport{TLS: tr.TLSClientConfig}
	defer bulk.Close()
	resp, err = (&http.Client{Transport: bulk, Timeout: 5 * time.Second}).Get(bpath + "?layers=0-1")
	if err != nil {
		t.Fatal(err)
	}
	bbody, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !bytes.Equal(bbody, body) || resp.Header.Get("Repr-Digest") != "sha-256=:+Yrl5A1vrxQNHQQbj8CsCJfygT5Vy3mGgpr26nPIRF8=:" || resp.Proto != "KVSP-BULK/1" {
		t.Fatalf("GET layers=0-1 over quicbulk: %s %d %d %q", resp.Proto, resp.StatusCode, len(bbody), resp.Header.Get("Repr-Digest"))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	if strings.Contains(logs.String(), strings.TrimSpace(string(key1))) {
		t.Fatal("a scope key reached the logs")
	}
}

// TestServeBadConfig: a bad configuration fails before anything listens,
// naming the field.
func TestServeBadConfig(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	cfg := writeFile(t, dir, "kvsp.yaml", testConfig)
	if code, _, errs := runCLI(t, "certs", "--config", cfg); code != 0 {
		t.Fatal(errs)
	}
	for field, mutate := range map[string]func(string) string{
		"index.max_lookup_keys": func(s string) string { return strings.Replace(s, "max_lookup_keys: 4096", "max_lookup_keys: 0", 1) },
		"holders[0].tiers[1].path": func(s string) string {
			return strings.Replace(s, ", path: store", "", 1)
		},
		"instances[0].engine.kind": func(s string) string { return strings.Replace(s, "kind: sim", "kind: vllm", 1) },
		"listen":                   func(s string) string { return strings.Replace(s, "127.0.0.1:0", "nowhere", 1) },
		"field lisen not found":    func(s string) string { return strings.Replace(s, "listen:", "lisen:", 1) },
		"holders[0].rdma: rdma: built without RDMA support": func(s string) string {
			return strings.Replace(s, "    record_ttl_ms: 60000\n", "    record_ttl_ms: 60000\n    rdma: {device: mlx5_0}\n", 1)
		},
		"rdma: rdma: built without RDMA support": func(s string) string {
			return strings.Replace(s, "    engine: {kind: sim", "    rdma: {device: mlx5_0}\n    engine: {kind: sim", 1)
		},
		"transport: want h2, h3 or quicbulk": func(s string) string {
			return strings.Replace(s, "quicbulk: true", "quicbulk: true\ntransport: pigeon", 1)
		},
		"holders[0].base": func(s string) string {
			return strings.Replace(s, "https://127.0.0.1:8443/h1/", "https://127.0.0.1:8443/h1", 1)
		},
	} {
		bad := writeFile(t, dir, "bad.yaml", mutate(testConfig))
		code, _, errs := runCLI(t, "serve", "--config", bad)
		if code != 1 || !strings.Contains(errs, field) {
			t.Errorf("%s: code %d, stderr %q", field, code, errs)
		}
	}
}

// TestInspect: a container written by the container package is decoded,
// verified and tabulated; a corrupted one is refused.
func TestInspect(t *testing.T) {
	dir := t.TempDir()
	desc := writeFile(t, dir, "d.json", appendixDescriptor)
	g := container.Geometry{Layers: 32, BlockTokens: 4, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	h, _ := container.NewHeader(container.CodecRaw, 0, 2, g)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	sec := make([]byte, 8192)
	w.WriteLayer(sec, sec)
	w.WriteLayer(sec, sec)
	w.Close()
	blk := writeFile(t, dir, "b.kvb", buf.String())
	code, out, errs := runCLI(t, "inspect", "--descriptor", desc, "--repr-digest", "sha-256=:+Yrl5A1vrxQNHQQbj8CsCJfygT5Vy3mGgpr26nPIRF8=:", blk)
	if code != 0 || !strings.Contains(out, "Repr-Digest verified") || !strings.Contains(out, "4fe7b59af6de3b665b67788cc2f99892ab827efae3a467342b3bb4e3bc8e5bfe") || !strings.Contains(out, "layers 0-1 of 32") {
		t.Fatalf("inspect: %d\n%s\n%s", code, out, errs)
	}
	writeFile(t, dir, "b.kvb", buf.String()[:100])
	if code, _, errs := runCLI(t, "inspect", "--descriptor", desc, blk); code != 1 || !strings.Contains(errs, "truncated") {
		t.Fatalf("truncated block: %d %s", code, errs)
	}
}

// TestKeysBlocks: the appendix tokens give K[0] and K[1] (R-KEY-4).
func TestKeysBlocks(t *testing.T) {
	dir := t.TempDir()
	desc := writeFile(t, dir, "d.json", appendixDescriptor)
	key := writeFile(t, dir, "k", "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n")
	toks := writeFile(t, dir, "t.json", "[128000, 791, 6460, 374, 264, 1296, 315, 279, 5]")
	code, out, errs := runCLI(t, "keys", "blocks", "--scope-key", key, "--descriptor", desc, toks)
	want := "9ca9d8b60f37f84726a27deb4cdc0d075714607a131632c2366e30b99fb1163b\n653275884ca44f8945fd4c902611c467394b73656e64c78d8522648cb75aefc1\n"
	if code != 0 || out != want {
		t.Fatalf("keys blocks: %d %q %s", code, out, errs)
	}
	if code, out, _ := runCLI(t, "keys", "scope", key); code != 0 || strings.TrimSpace(out) != "6d1c6481cd428737da312c089db3832a" {
		t.Fatalf("keys scope: %q", out)
	}
	raw := writeFile(t, dir, "raw", string(bytes.Repeat([]byte{0xfe}, 32)))
	if code, _, _ := runCLI(t, "keys", "scope", raw); code != 0 {
		t.Fatal("raw 32-octet key file refused")
	}
	short := writeFile(t, dir, "short", string(bytes.Repeat([]byte{0xfe}, 31)))
	if code, _, _ := runCLI(t, "keys", "scope", short); code != 1 {
		t.Fatal("31-octet key file accepted")
	}
}

// TestExampleConfig: the README's example configuration stays valid.
func TestExampleConfig(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"kvsp.yaml", "descriptor.json"} {
		data, err := os.ReadFile(filepath.Join("..", "..", "examples", "dev", f))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, dir, f, string(data))
	}
	if code, _, errs := runCLI(t, "certs", "--config", filepath.Join(dir, "kvsp.yaml")); code != 0 {
		t.Fatal(errs)
	}
	if _, err := config.Load(filepath.Join(dir, "kvsp.yaml")); err != nil {
		t.Fatal(err)
	}
}
