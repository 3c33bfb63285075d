package holder_test

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/h2"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/internal/sockio"
)

// TestHolderServerProcess is not a test: BenchmarkVersusNginx runs the
// test binary with it selected, to serve one block from a holder in a
// process of its own (so its CPU time can be compared with nginx's).
func TestHolderServerProcess(t *testing.T) {
	if os.Getenv("KVSP_HOLDER_SERVER") == "" {
		t.Skip("the server process of BenchmarkVersusNginx")
	}
	if os.Getenv("KVSP_ONE_P") == "1" {
		runtime.GOMAXPROCS(1)
	}
	bf := newBenchFixtureOpts(t, 1, 1<<30, kvsptest.Options{NetHTTP2: os.Getenv("KVSP_HOLDER_NETHTTP2") == "1", PlainSockets: os.Getenv("KVSP_PLAIN_SOCKETS") == "1"})
	bf.pki.WriteLeaf("client.pem", "client.key", bf.pki.Leaf(kvsptest.ClientA))
	ref := bf.refs[0]
	kvsptest.ServeFromProcess(t, bf.srv.URL("/h1/blocks/"+ref.Compat.String()+"/"+ref.Scope.String()+"/"+ref.Key.String()), bf.pki, "KVSP_HOLDER_CPUPROFILE")
}

// TestTLSFloorProcess is not a test: the benchmarks run the test binary
// with it selected for their floors, servers that are crypto/tls and
// little else: the holder's certificate and client verification
// (KVSP_TLS_FLOOR names the holder process's PKI directory), no routing,
// no authorization, no store. Over HTTP/1.1 each response is one Write of
// a status line, two headers and the block; over HTTP/2 it is
// serveH2Floor's. What they cost per GB is crypto/tls's sealing and the
// write syscalls of the same octets to the same client. KVSP_FLOOR_KIND
// picks what HTTP/2 adds above that floor, to measure it:
//
//   - "" (tls-floor): serveH2Floor, one reader and one writer goroutine;
//   - "handlers" (tls-floor-handlers): the same, each request also given
//     a goroutine of its own that hands its body to the writer and waits
//     for its end, as a net/http handler does;
//   - "bare" (bare): the holder's HTTP servers without the holder,
//     net/http's for HTTP/1.1 and internal/h2 (with its defaults) for
//     HTTP/2, with a two-line handler writing the block from memory.
//
// Its sockets are read and written as the holder's are, through
// internal/sockio; KVSP_PLAIN_SOCKETS=1 uses net.TCPConn's own Read and
// Write. KVSP_ONE_P=1 runs it with one P, KVSP_FLOOR_BODY=n serves the block's
// first n octets, KVSP_FLOOR_CPUPROFILE writes a CPU profile.
func TestTLSFloorProcess(t *testing.T) {
	dir := os.Getenv("KVSP_TLS_FLOOR")
	if dir == "" {
		t.Skip("the TLS floor process of BenchmarkVersusNginx")
	}
	if os.Getenv("KVSP_ONE_P") == "1" {
		runtime.GOMAXPROCS(1)
	}
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key"))
	if err != nil {
		t.Fatal(err)
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, "ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AppendCertsFromPEM(caPEM)
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if os.Getenv("KVSP_PLAIN_SOCKETS") != "1" {
		tcp = sockio.Listener{Listener: tcp} // as the holder's server.Serve
	}
	ln := tls.NewListener(tcp, &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas, NextProtos: []string{"h2", "http/1.1"}})
	defer ln.Close()
	data, _ := benchBlockBytes()
	if n, err := strconv.Atoi(os.Getenv("KVSP_FLOOR_BODY")); err == nil && n < len(data) {
		data = data[:n]
	}
	kind := os.Getenv("KVSP_FLOOR_KIND")
	h2srv := h2.New(h2.Config{})
	bare := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/kvsp-block")
		w.Header().Set("Content-Length", strconv.Itoa(len(data)))
		w.Write(data)
	})
	if kind == "bare" {
		hs := &http.Server{Handler: bare}
		h2srv.Configure(hs)
		go hs.Serve(ln)
		kvsptest.ServeFromProcess(t, "https://"+ln.Addr().String()+"/block", &kvsptest.PKI{Dir: dir}, "KVSP_FLOOR_CPUPROFILE")
		return
	}
	resp := append([]byte("HTTP/1.1 200 OK\r\nContent-Type: application/kvsp-block\r\nContent-Length: "+strconv.Itoa(len(data))+"\r\n\r\n"), data...)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				tc := c.(*tls.Conn)
				if tc.Handshake() != nil {
					return
				}
				if tc.ConnectionState().NegotiatedProtocol == "h2" {
					serveH2Floor(tc, data, kind == "handlers")
					return
				}
				r := bufio.NewReader(c)
				for {
					for { // the request's head, up to its blank line
						l, err := r.ReadSlice('\n')
						if err != nil {
							return
						}
						if len(l) <= 2 {
							break
						}
					}
					if _, err := c.Write(resp); err != nil {
						return
					}
				}
			}()
		}
	}()
	kvsptest.ServeFromProcess(t, "https://"+ln.Addr().String()+"/block", &kvsptest.PKI{Dir: dir}, "KVSP_FLOOR_CPUPROFILE")
}

// BenchmarkVersusNginx serves the same 2 MiB container from the holder and
// from nginx (Debian's, started here on 127.0.0.1 with the same server
// certificate and client-certificate verification), each in its own
// process, and fetches both with the same verifying client in this one:
// the body read, SHA-256 of the container and of every layer compared with
// the known digests. Every row also fetches it from the TLS floor
// (TestTLSFloorProcess): what crypto/tls alone costs for those octets.
// The HTTP/2 rows add the holder on net/http's HTTP/2, the holder and the
// floor with one P, the floor with a goroutine per request, and
// the holder's HTTP servers serving the block without the holder (bare,
// in every row): between
// them they measure what each layer above crypto/tls costs.
// Runs alternate the peers; each reports its throughput, the server's
// CPU-seconds per GB, and its write and read system calls and context
// switches per block. Set KVSP_BENCH_NGINX=1 (make bench-holder does);
// nginx must be installed.
func BenchmarkVersusNginx(b *testing.B) {
	if os.Getenv("KVSP_BENCH_NGINX") != "1" {
		b.Skip("set KVSP_BENCH_NGINX=1 (make bench-holder)")
	}
	data, blk := benchBlockBytes()

	// The holder, in a process of its own; and one whose HTTP/2 is
	// net/http's, for HTTP/2's rows (what internal/h2 replaced).
	// KVSP_HOLDER_CPUPROFILE and KVSP_FLOOR_CPUPROFILE profile hp and fp
	// alone (the last of a key in a process's environment is the one used).
	hp := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1")
	pem := hp.Path
	np := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_HOLDER_NETHTTP2=1", "KVSP_HOLDER_CPUPROFILE=")
	// And the holder with one P (GOMAXPROCS=1), for HTTP/2's rows: what
	// the Go scheduler's wake-ups across Ps cost when one connection
	// idles between the client's WINDOW_UPDATEs.
	op := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_ONE_P=1", "KVSP_HOLDER_CPUPROFILE=")
	// And the holder and the floor reading and writing their sockets with
	// net.TCPConn's own Read and Write (system calls through the runtime's
	// hand-off, which wake its monitor thread), not internal/sockio's.
	pp := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_PLAIN_SOCKETS=1", "KVSP_HOLDER_CPUPROFILE=")
	floor := func(env ...string) *kvsptest.Process {
		return kvsptest.StartProcess(b, "TestTLSFloorProcess", append([]string{"KVSP_TLS_FLOOR=" + filepath.Dir(pem("ca.pem"))}, env...)...)
	}
	fp := floor()
	fpp := floor("KVSP_PLAIN_SOCKETS=1", "KVSP_FLOOR_CPUPROFILE=")
	fop := floor("KVSP_ONE_P=1", "KVSP_FLOOR_CPUPROFILE=")
	fhp := floor("KVSP_FLOOR_KIND=handlers", "KVSP_FLOOR_CPUPROFILE=")
	bp := floor("KVSP_FLOOR_KIND=bare", "KVSP_FLOOR_CPUPROFILE=")
	ngxURL, ngxPid := startNginx(b, pem, data)
	procs := map[string]*kvsptest.Process{"holder": hp, "holder-plain": pp, "holder-nethttp2": np, "holder-1p": op,
		"tls-floor": fp, "tls-floor-plain": fpp, "tls-floor-1p": fop, "tls-floor-handlers": fhp, "bare": bp}
	pids := map[string]int{"nginx": ngxPid}
	urls := map[string]string{"nginx": ngxURL + "/block"}
	for name, p := range procs {
		pids[name], urls[name] = p.Pid, p.URL
	}

	wantWhole := blk.ContainerDigest()
	layers := blk.LayerDigests()
	verify := func(body []byte) error { // the same verification for both servers
		if sha256.Sum256(body) != wantWhole {
			return fmt.Errorf("container digest")
		}
		off := container.HeaderLen(32)
		for i := range layers {
			n := 2 * int(benchGeom.RawSectionLen())
			if sha256.Sum256(body[off:off+n]) != layers[i] {
				return fmt.Errorf("layer %d", i)
			}
			off += n
		}
		return nil
	}
	for _, proto := range []string{"http1", "h2"} {
		for _, clients := range []int{1, 8} {
			for _, peer := range []string{"nginx", "holder", "holder-plain", "holder-nethttp2", "holder-1p", "tls-floor", "tls-floor-plain", "tls-floor-1p", "tls-floor-handlers", "bare"} {
				if proto != "h2" && (peer == "holder-nethttp2" || strings.HasSuffix(peer, "-1p") || peer == "tls-floor-handlers") {
					continue // HTTP/2's questions: its server, one P, its layers above the floor
				}
				b.Run(fmt.Sprintf("%s/clients=%d/%s", proto, clients, peer), func(b *testing.B) {
					proc := hp // nginx and the floor have hp's certificate
					switch peer {
					case "holder-nethttp2":
						proc = np
					case "holder-1p":
						proc = op
					case "holder-plain":
						proc = pp
					}
					tc := proc.ClientTLS(b, "h2", "http/1.1")
					if proto == "http1" {
						tc.NextProtos = []string{"http/1.1"}
					}
					tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: proto == "h2", MaxIdleConnsPerHost: 16,
						HTTP2: &http.HTTP2Config{MaxReadFrameSize: 1 << 20, MaxReceiveBufferPerConnection: 3 << 20, MaxReceiveBufferPerStream: 3 << 20}}
					defer tr.CloseIdleConnections()
					c := &http.Client{Transport: tr}
					b.SetBytes(int64(len(data)))
					cpu := drive(b, c, urls[peer], clients, len(data), verify, pids[peer])
					b.ReportMetric(cpu.Seconds()/(float64(b.N)*float64(len(data))/1e9), "server-cpu-s/GB")
				})
			}
		}
	}
}

// startNginx starts nginx (Debian's) on 127.0.0.1 serving data as /block,
// with the holder process's certificate and
// client-certificate verification (pem names its PKI files), and
// returns its base URL and master's pid; it stops with the benchmark.
func startNginx(b *testing.B, pem func(string) string, data []byte) (string, int) {
	ngx, err := exec.LookPath("nginx")
	if err != nil {
		b.Fatal("nginx not installed")
	}
	ndir := b.TempDir()
	os.WriteFile(filepath.Join(ndir, "block"), data, 0o644)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	conf := fmt.Sprintf(`daemon off; user root; worker_processes 2; pid %[1]s/nginx.pid; error_log %[1]s/error.log;
events { worker_connections 256; }
http { access_log off; sendfile on; keepalive_requests 100000; client_body_temp_path %[1]s; proxy_temp_path %[1]s;
  fastcgi_temp_path %[1]s; uwsgi_temp_path %[1]s; scgi_temp_path %[1]s;
  server { listen 127.0.0.1:%[2]d ssl http2; ssl_protocols TLSv1.3;
    ssl_certificate %[3]s; ssl_certificate_key %[4]s; ssl_client_certificate %[5]s; ssl_verify_client on;
    root %[1]s; location / { default_type application/kvsp-block; } } }
`, ndir, port, pem("server.pem"), pem("server.key"), pem("ca.pem"))
	os.WriteFile(filepath.Join(ndir, "nginx.conf"), []byte(conf), 0o644)
	cmd := exec.Command(ngx, "-c", filepath.Join(ndir, "nginx.conf"), "-p", ndir)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Signal(syscall.SIGQUIT); cmd.Wait() })
	for i := 0; i < 100; i++ {
		if c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
			c.Close()
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return "https://127.0.0.1:" + strconv.Itoa(port), cmd.Process.Pid
}

// BenchmarkH2PerRequest is BenchmarkVersusNginx's HTTP/2 row at 8 clients
// with 1 KiB bodies: server CPU per request, where the 2 MiB rows measure
// it per octet. It tells what a request costs each server apart from the
// octets it sends: at 2 MiB a block, a GB is 477 requests.
func BenchmarkH2PerRequest(b *testing.B) {
	if os.Getenv("KVSP_BENCH_NGINX") != "1" {
		b.Skip("set KVSP_BENCH_NGINX=1 (make bench-holder)")
	}
	const size = 1 << 10
	data, _ := benchBlockBytes()
	hp := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_HOLDER_CPUPROFILE=") // its PKI
	floor := func(env ...string) *kvsptest.Process {
		return kvsptest.StartProcess(b, "TestTLSFloorProcess", append([]string{"KVSP_TLS_FLOOR=" + filepath.Dir(hp.Path("ca.pem")), "KVSP_FLOOR_BODY=" + strconv.Itoa(size), "KVSP_FLOOR_CPUPROFILE="}, env...)...)
	}
	ngxURL, ngxPid := startNginx(b, hp.Path, data[:size])
	pids := map[string]int{"nginx": ngxPid}
	urls := map[string]string{"nginx": ngxURL + "/block"}
	for name, p := range map[string]*kvsptest.Process{"tls-floor": floor(), "tls-floor-handlers": floor("KVSP_FLOOR_KIND=handlers"), "bare": floor("KVSP_FLOOR_KIND=bare")} {
		pids[name], urls[name] = p.Pid, p.URL
	}
	for _, peer := range []string{"nginx", "tls-floor", "tls-floor-handlers", "bare"} {
		b.Run("clients=8/"+peer, func(b *testing.B) {
			tr := &http.Transport{TLSClientConfig: hp.ClientTLS(b, "h2"), ForceAttemptHTTP2: true}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr}
			cpu := drive(b, c, urls[peer], 8, size, func(body []byte) error {
				if !bytes.Equal(body, data[:size]) {
					return fmt.Errorf("not the block's first %d octets", size)
				}
				return nil
			}, pids[peer])
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "server-µs/op")
		})
	}
}

// drive fetches url b.N times from clients goroutines sharing c, each
// response's body (size octets) read whole and checked, and meanwhile
// measures the server process pid: it returns the server's CPU time and
// reports its write and read system calls and context switches per
// fetch (what the CPU bought).
func drive(b *testing.B, c *http.Client, url string, clients, size int, check func([]byte) error, pid int) time.Duration {
	return driveRequests(b, func() (*http.Response, error) { return c.Get(url) }, url, clients, size, check, pid)
}

// driveRequests is drive with the request made by fetch.
func driveRequests(b *testing.B, fetch func() (*http.Response, error), url string, clients, size int, check func([]byte) error, pid int) time.Duration {
	work := make(chan struct{})
	var wg sync.WaitGroup
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := make([]byte, size)
			for range work {
				resp, err := fetch()
				if err != nil {
					b.Error(err)
					return
				}
				if resp.StatusCode != 200 {
					msg, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					b.Errorf("%s: %d %s", url, resp.StatusCode, msg)
					return
				}
				_, err = io.ReadFull(resp.Body, body)
				resp.Body.Close()
				if err == nil {
					err = check(body)
				}
				if err != nil {
					b.Errorf("%s: %v", url, err)
					return
				}
			}
		}()
	}
	meter := kvsptest.NewCPUMeter(pid)
	counts0, _ := kvsptest.ProcessTreeCounts(pid)
	meter.Start()
	for range b.N {
		work <- struct{}{}
	}
	close(work)
	wg.Wait()
	meter.Stop()
	counts, _ := kvsptest.ProcessTreeCounts(pid)
	n := float64(b.N)
	b.ReportMetric(float64(counts.Writes-counts0.Writes)/n, "server-writes/op")
	b.ReportMetric(float64(counts.Reads-counts0.Reads)/n, "server-reads/op")
	b.ReportMetric(float64(counts.Switches-counts0.Switches)/n, "server-switches/op")
	return meter.Peers
}

// BenchmarkHeadPerRequest: HEAD requests for the 2 MiB block, 8 clients,
// to the holder and to its HTTP servers without it (bare), over HTTP/1.1
// and HTTP/2: the server's CPU per request with no body to send, what
// the holder's handler (routing, authorization, the store's lookup, its
// headers and metrics) adds to a request.
func BenchmarkHeadPerRequest(b *testing.B) {
	if os.Getenv("KVSP_BENCH_NGINX") != "1" {
		b.Skip("set KVSP_BENCH_NGINX=1 (make bench-holder)")
	}
	hp := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_HOLDER_CPUPROFILE=")
	bp := kvsptest.StartProcess(b, "TestTLSFloorProcess", "KVSP_TLS_FLOOR="+filepath.Dir(hp.Path("ca.pem")), "KVSP_FLOOR_KIND=bare", "KVSP_FLOOR_CPUPROFILE=")
	for _, proto := range []string{"http1", "h2"} {
		for _, peer := range []*kvsptest.Process{hp, bp} {
			name := "holder"
			if peer == bp {
				name = "bare"
			}
			b.Run(proto+"/clients=8/"+name, func(b *testing.B) {
				tc := hp.ClientTLS(b, "h2", "http/1.1")
				if proto == "http1" {
					tc.NextProtos = []string{"http/1.1"}
				}
				tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: proto == "h2", MaxIdleConnsPerHost: 16}
				defer tr.CloseIdleConnections()
				c := &http.Client{Transport: tr}
				cpu := driveRequests(b, func() (*http.Response, error) { return c.Head(peer.URL) }, peer.URL, 8, 0, func([]byte) error { return nil }, peer.Pid)
				b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "server-µs/op")
			})
		}
	}
}
