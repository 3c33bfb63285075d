package main

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// proc is a `kvsp serve` subprocess.
type proc struct {
	cmd  *exec.Cmd
	addr string
	logs *syncBuffer
}

// syncBuffer is a log buffer written by a subprocess's stderr copier.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func startServe(t *testing.T, cfg, addr string, env ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVSP_TEST_ARGS=serve\x1f--config\x1f"+cfg)
	cmd.Env = append(cmd.Env, env...)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, addr: addr, logs: logs}
	t.Cleanup(func() {
		p.kill()
		if t.Failed() && os.Getenv("KVSP_TEST_LOGS") != "" {
			t.Logf("logs of kvsp serve %s:\n%s", cfg, logs.String())
		}
	})
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return p
		}
		if p.exited() {
			// A process armed to die at a failpoint may get there before
			// a dial sees it listening (F15: a PC restarted with a
			// checkpoint failpoint receives the instance's retried
			// checkpoint at once): started, it is the caller's.
			if strings.Contains(logs.String(), `"msg":"serving"`) {
				return p
			}
			t.Fatalf("kvsp serve exited before it listened on %s:\n%s", addr, logs.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("kvsp serve did not listen on %s:\n%s", addr, logs.String())
	return nil
}

// exited reports a process that ended on its own (a zombie not yet
// waited for: kill reaps it).
func (p *proc) exited() bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return true
	}
	_, rest, _ := strings.Cut(string(b), ") ")
	return strings.HasPrefix(rest, "Z")
}

// kill sends SIGKILL: nothing is flushed, nothing is withdrawn.
func (p *proc) kill() {
	if p.cmd.Process != nil && p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(syscall.SIGKILL)
		p.cmd.Wait()
	}
}

// TestKilledMidTransfer: a holder process killed with SIGKILL in the
// middle of a PUT and in the middle of a GET: the clients see errors,
// never wrong or complete-looking bytes, and after a restart no partial
// block exists while the blocks the local-storage tier had stored are
// served again (issue 6).
func TestKilledMidTransfer(t *testing.T) {
	dir := t.TempDir()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	conf := strings.Replace(testConfig, "127.0.0.1:0", addr, 1)
	// Host memory for one block, so the first block is demoted to disk.
	// Blocks of 16 MiB (64 tokens x 8 heads x 128 x fp32 x 32 layers): far
	// more than socket buffers hold, so a kill really cuts the stream.
	conf = strings.Replace(conf, "{name: host, capacity: 1GiB, read_mbit_per_s: 400000}", "{name: host, capacity: 20MiB, read_mbit_per_s: 400000}", 1)
	cfg := writeFile(t, dir, "kvsp.yaml", conf)
	desc := strings.Replace(strings.Replace(appendixDescriptor, `"block_tokens": 4`, `"block_tokens": 64`, 1), `"bf16"`, `"fp32"`, 1)
	writeFile(t, dir, "descriptor.json", desc)
	d, err := kvsp.ParseDescriptor([]byte(desc))
	if err != nil {
		t.Fatal(err)
	}
	compat, _ := d.CompatID()
	if code, _, errs := runCLI(t, "certs", "--config", cfg); code != 0 {
		t.Fatal(errs)
	}
	key1, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	sk, _ := kvsp.ScopeKeyFromFile(key1)
	// The process's own identity (an instance: a producer of KV) stores
	// blocks; the tool client may only read them (S13).
	pair, _ := tls.LoadX509KeyPair(filepath.Join(dir, "self.pem"), filepath.Join(dir, "self.key"))
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(ca)
	newClient := func() *http.Client {
		small := &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
			return c.Control(func(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 64<<10) })
		}}
		tr := &http.Transport{DialContext: small.DialContext, TLSClientConfig: &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: roots, Certificates: []tls.Certificate{pair}, NextProtos: []string{"http/1.1"}}}
		t.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr, Timeout: 20 * time.Second}
	}
	g := container.Geometry{Layers: 32, BlockTokens: 64, KVHeads: 8, HeadDim: 128, Elem: container.FP32}
	block := func(seed byte) []byte {
		h, _ := container.NewHeader(container.CodecRaw, 0, 32, g)
		var b bytes.Buffer
		w := container.NewWriter(&b, h)
		for i := 0; i < 32; i++ {
			s := bytes.Repeat([]byte{seed, byte(i)}, int(g.RawSectionLen()/2))
			w.WriteLayer(s, s)
		}
		w.Close()
		return b.Bytes()
	}
	url := func(k byte) string {
		return fmt.Sprintf("https://%s/h1/blocks/%s/%s/%s", addr, compat, sk.ID(), strings.Repeat(fmt.Sprintf("%02x", k), 32))
	}
	put := func(c *http.Client, k byte, body io.Reader, n int64) (*http.Response, error) {
		req, _ := http.NewRequest("PUT", url(k), body)
		req.ContentLength = n
		req.Header.Set("If-None-Match", "*")
		req.Header.Set("Content-Type", "application/kvsp-block")
		return c.Do(req)
	}

	p := startServe(t, cfg, addr)
	c := newClient()
	b1, b2 := block(1), block(2)
	for k, b := range map[byte][]byte{1: b1} {
		resp, err := put(c, k, bytes.NewReader(b), int64(len(b)))
		if err != nil || resp.StatusCode != 201 {
			t.Fatalf("PUT %d: %v %v", k, resp, err)
		}
		resp.Body.Close()
	}
	resp, err := put(c, 2, bytes.NewReader(b2), int64(len(b2))) // demotes block 1 to disk
	if err != nil || resp.StatusCode != 201 {
		t.Fatalf("PUT 2: %v %v", resp, err)
	}
	resp.Body.Close()

	// Mid-GET: read part of block 2, then kill the process.
	resp, err = c.Get(url(2))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET 2: %v %v", resp, err)
	}
	part := make([]byte, 1000)
	io.ReadFull(resp.Body, part)
	// Mid-PUT: half of block 3 is sent, the rest never comes.
	pr, pw := io.Pipe()
	putErr := make(chan error, 1)
	go func() {
		r, err := put(newClient(), 3, pr, int64(len(b1)))
		if err == nil {
			r.Body.Close()
			if r.StatusCode < 300 {
				err = fmt.Errorf("a half-sent PUT was accepted: %d", r.StatusCode)
			} else {
				err = fmt.Errorf("status %d", r.StatusCode)
			}
		}
		putErr <- err
	}()
	pw.Write(b1[:len(b1)/2])
	time.Sleep(100 * time.Millisecond)
	p.kill()
	rest, rerr := io.ReadAll(resp.Body)
	resp.Body.Close()
	if rerr == nil && len(part)+len(rest) == len(b2) {
		t.Fatal("the GET completed although the holder was killed mid-stream")
	}
	pw.CloseWithError(io.ErrClosedPipe)
	if err := <-putErr; err == nil {
		t.Fatal("the PUT reported success")
	}

	// Restart: block 3 does not exist; block 1 (on disk) is served intact.
	startServe(t, cfg, addr)
	c2 := newClient()
	if r, err := c2.Get(url(3)); err != nil || r.StatusCode != 404 {
		t.Fatalf("after restart, the half-sent block: %v %v", r, err)
	} else {
		r.Body.Close()
	}
	r, err := c2.Get(url(1))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if r.StatusCode != 200 || !bytes.Equal(got, b1) {
		t.Fatalf("after restart, the block on disk: %d, %d octets", r.StatusCode, len(got))
	}
}
