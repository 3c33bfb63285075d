package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/gpu"
)

// TestEngineAttachThroughServe (the GPU issue's attach path, end to end on
// the nogpu stand-in): `kvsp serve` with a device tier and an attach
// socket; an engine attaches its memfd pool, publishes a block by page,
// and a client GETs it over mutual TLS: the octets are the container of
// the engine's page, verified by its Repr-Digest.
// serveOnDevice runs `kvsp serve` on testConfig with old replaced by new,
// on a device (the nogpu stand-in under make test; skipped in a build
// without one), until the test ends; it returns the configuration's
// directory and the address served.
func serveOnDevice(t *testing.T, old, new string) (dir, addr string) {
	t.Helper()
	if d, err := gpu.Open(0); err != nil {
		if errors.Is(err, gpu.ErrNoDevice) {
			t.Skipf("no device in this build (%v): make test runs it on the stand-in", err)
		}
		t.Fatal(err)
	} else {
		d.Close()
	}
	dir = t.TempDir()
	cfg := writeFile(t, dir, "kvsp.yaml", strings.Replace(testConfig, old, new, 1))
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	if code, _, errs := runCLI(t, "certs", "--config", cfg); code != 0 {
		t.Fatal(errs)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	done := make(chan error, 1)
	go func() { done <- serve(ctx, []string{"--config", cfg}, io.Discard, nil, ready) }()
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("serve: %v", err)
	}
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("shutdown: %v", err)
		}
	})
	return dir, addr
}

// memfdPool is an engine's pool in a memfd of size octets, mapped shared
// (closed when the test ends).
func memfdPool(t *testing.T, size int64) (int, []byte) {
	t.Helper()
	fd, err := unix.MemfdCreate("engine-pool", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem); unix.Close(fd) })
	return fd, mem
}

func TestEngineAttachThroughServe(t *testing.T) {
	dir, addr := serveOnDevice(t,
		"tiers: [{name: host, capacity: 1GiB, read_mbit_per_s: 400000}, {name: local-storage, capacity: 10GiB, path: store}]",
		"tiers: [{name: device, capacity: 1GiB, device: 0}, {name: host, capacity: 1GiB, read_mbit_per_s: 400000}]\n    attach_socket: attach.sock")
	if fi, err := os.Stat(filepath.Join(dir, "attach.sock")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("attach socket: %v %v", fi, err)
	}

	// The appendix model: 32 layers of 4 tokens x 8 heads x 128 bf16.
	const sec, layers, pages = 8192, 32, 2
	pool := attach.Pool{Memory: attach.MemoryMemfd, Pages: pages, PageTokens: 4, PageStride: sec, VOffset: pages * sec,
		LayerStride: 2 * pages * sec, Size: layers * 2 * pages * sec}
	fd, mem := memfdPool(t, pool.Size)
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range mem {
		mem[i] = byte(rng.Uint32())
	}
	g := container.Geometry{Layers: layers, BlockTokens: 4, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	hdr, _ := container.NewHeader(container.CodecRaw, 0, layers, g)
	var want bytes.Buffer
	w := container.NewWriter(&want, hdr)
	for l := range layers {
		k, v := pool.Section(l, 1)
		w.WriteLayer(mem[k:k+sec], mem[v:v+sec])
	}
	w.Close()
	compat, _ := kvsp.ParseCompatID("5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f")
	e, err := attach.Dial(filepath.Join(dir, "attach.sock"), &attach.Hello{Engine: "test", CompatID: compat, Pool: pool}, fd)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	keyFile, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(keyFile)
	key := kvsp.BlockKey{0xab, 1}
	if err := e.Publish(sk.ID(), []attach.Placement{{BlockKey: key, Page: 1}}); err != nil {
		t.Fatal(err)
	}
	pair, _ := tls.LoadX509KeyPair(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key"))
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	tr := &http.Transport{TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}}, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	resp, err := hc.Get("https://" + addr + "/h1/blocks/" + compat.String() + "/" + sk.ID().String() + "/" + key.String())
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	d, _ := container.OpenBlock(want.Bytes(), g)
	if resp.StatusCode != 200 || !bytes.Equal(body, want.Bytes()) || resp.Header.Get("Repr-Digest") != container.ReprDigest(d.ContainerDigest()) {
		t.Fatalf("GET of the engine's page: %d, %d octets, equal %v, %q", resp.StatusCode, len(body), bytes.Equal(body, want.Bytes()), resp.Header.Get("Repr-Digest"))
	}
}

// TestConnectedEngineGetsPrefetchedBlocks (the agent's side of attach, end
// to end on the stand-in): an instance whose engine is `connected`; the
// engine attaches to the agent's socket with a memfd pool of pages of 2
// tokens (a block takes two) and lends four pages; a block is stored at
// the holder; a prefetch directive makes the agent fetch it (verified) and
// write it into two lent pages; the engine claims it, and its own pool
// holds the block's rows where its layout says.
func TestConnectedEngineGetsPrefetchedBlocks(t *testing.T) {
	dir, addr := serveOnDevice(t,
		"engine: {kind: sim, descriptor: descriptor.json, prefill_tokens_per_s: 42000, decode_tokens_per_s: 3100}",
		"engine: {kind: connected, descriptor: descriptor.json, attach_socket: ii.sock}")

	// The engine's pool: pages of 2 tokens of the appendix model.
	const row, layers, pages = 2048, 32, 6
	pool := attach.Pool{Memory: attach.MemoryMemfd, Pages: pages, PageTokens: 2, PageStride: 2 * row}
	pool.VOffset = pages * pool.PageStride
	pool.LayerStride = 2 * pool.VOffset
	pool.Size = layers * pool.LayerStride
	fd, mem := memfdPool(t, pool.Size)
	compat, _ := kvsp.ParseCompatID("5ed5c2f238839655d7c4029e12b7f31caf9e7421f4edb4057feee6dab760ee0f")
	en, err := attach.Dial(filepath.Join(dir, "ii.sock"), &attach.Hello{Engine: "test", CompatID: compat, Pool: pool}, fd)
	if err != nil {
		t.Fatal(err)
	}
	defer en.Close()
	if err := en.Lend([]int{4, 1, 5, 0}); err != nil {
		t.Fatal(err)
	}

	// A block at the holder, PUT by the tool client.
	g := container.Geometry{Layers: layers, BlockTokens: 4, KVHeads: 8, HeadDim: 128, Elem: container.BF16}
	hdr, _ := container.NewHeader(container.CodecRaw, 0, layers, g)
	var blk bytes.Buffer
	w := container.NewWriter(&blk, hdr)
	rng := rand.New(rand.NewPCG(9, 9))
	sections := make([][2][]byte, layers)
	for l := range layers {
		for kv := range 2 {
			sections[l][kv] = make([]byte, 4*row)
			for i := range sections[l][kv] {
				sections[l][kv][i] = byte(rng.Uint32())
			}
		}
		w.WriteLayer(sections[l][0], sections[l][1])
	}
	dg, _ := w.Close()
	keyFile, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(keyFile)
	key := kvsp.BlockKey{0xcd, 2}
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	mk := func(name string) *client.Client {
		pair, _ := tls.LoadX509KeyPair(filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key"))
		c, err := client.New(client.Config{TLS: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(c.Close)
		return c
	}
	ref := client.BlockRef{Compat: compat, Scope: sk.ID(), Key: key}
	h1 := "https://" + addr + "/h1/"
	if err := mk("self").Holder(h1).PutBlock(context.Background(), ref, bytes.NewReader(blk.Bytes()), int64(blk.Len()), dg.Container); err != nil { // a producer of KV: this process's identity (an instance)
		t.Fatal(err)
	}
	// The PC's identity (this process's) sends the directive; the source
	// is the holder as the agent reaches it.
	ii := mk("self").Instance("https://" + addr + "/ii1/")
	d := &kvsp.PrefetchDirective{Directive: kvsp.NewUUID(), ScopeID: sk.ID(), CompatID: compat, DeadlineMs: 10000, LeaseMs: 5000,
		Blocks: []kvsp.PrefetchBlock{{BlockKey: key, Sources: []string{h1}}}}
	if _, err := ii.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := ii.PrefetchStatus(context.Background(), d.Directive)
		if err != nil {
			t.Fatal(err)
		}
		if st.State == kvsp.PrefetchComplete {
			break
		}
		if st.State != kvsp.PrefetchPending || time.Now().After(deadline) {
			t.Fatalf("prefetch into the engine's pages: %+v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The engine runs its own requests: the agent's generate refuses, before
	// it answers anything.
	gen := &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: sk.ID(), CompatID: compat, Tokens: []uint32{1, 2}, MaxTokens: 1}
	if err := mk("client").Instance("https://"+addr+"/ii1/").Generate(context.Background(), gen, func(kvsp.GeneratedToken) error { return nil }); !errors.Is(err, kvsp.ErrInvalidState) {
		t.Fatalf("generate at a connected instance: %v", err)
	}
	got, err := en.Claim()
	if err != nil || len(got) != 1 || got[0].BlockKey != key || len(got[0].Pages) != 2 {
		t.Fatalf("claim: %+v %v", got, err)
	}
	for l := range layers {
		for kv := range 2 {
			for tok := range 4 {
				page := got[0].Pages[tok/2]
				k, v := pool.Section(l, page)
				off := []int64{k, v}[kv] + int64(tok%2)*row
				if !bytes.Equal(mem[off:off+row], sections[l][kv][tok*row:(tok+1)*row]) {
					t.Fatalf("layer %d %s token %d is not in the engine's page %d", l, []string{"K", "V"}[kv], tok, page)
				}
			}
		}
	}
}
