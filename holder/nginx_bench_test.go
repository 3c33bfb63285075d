package holder_test

import (
	"bufio"
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
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// TestHolderServerProcess is not a test: BenchmarkVersusNginx runs the
// test binary with it selected, to serve one block from a holder in a
// process of its own (so its CPU time can be compared with nginx's).
func TestHolderServerProcess(t *testing.T) {
	if os.Getenv("KVSP_HOLDER_SERVER") == "" {
		t.Skip("the server process of BenchmarkVersusNginx")
	}
	if os.Getenv("KVSP_HOLDER_ONE_P") == "1" {
		runtime.GOMAXPROCS(1)
	}
	bf := newBenchFixtureOpts(t, 1, 1<<30, os.Getenv("KVSP_HOLDER_NETHTTP2") == "1")
	bf.pki.WriteLeaf("client.pem", "client.key", bf.pki.Leaf(kvsptest.ClientA))
	ref := bf.refs[0]
	kvsptest.ServeFromProcess(t, bf.srv.URL("/h1/blocks/"+ref.Compat.String()+"/"+ref.Scope.String()+"/"+ref.Key.String()), bf.pki, "KVSP_HOLDER_CPUPROFILE")
}

// TestTLSFloorProcess is not a test: BenchmarkVersusNginx runs the test
// binary with it selected for the HTTP/1.1 rows' floor, a server that is
// crypto/tls and nothing else: the holder's certificate and client
// verification (KVSP_TLS_FLOOR names the holder process's PKI directory),
// no routing, no authorization, no store, each response one Write of a
// status line, two headers and the block. What it costs per GB is
// crypto/tls's sealing and the write syscalls of the same octets to the
// same client.
func TestTLSFloorProcess(t *testing.T) {
	dir := os.Getenv("KVSP_TLS_FLOOR")
	if dir == "" {
		t.Skip("the TLS floor process of BenchmarkVersusNginx")
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
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{cert},
		ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: cas, NextProtos: []string{"http/1.1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	data, _ := benchBlockBytes()
	resp := append([]byte("HTTP/1.1 200 OK\r\nContent-Type: application/kvsp-block\r\nContent-Length: "+strconv.Itoa(len(data))+"\r\n\r\n"), data...)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
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
	kvsptest.ServeFromProcess(t, "https://"+ln.Addr().String()+"/block", &kvsptest.PKI{Dir: dir}, "")
}

// BenchmarkVersusNginx serves the same 2 MiB container from the holder and
// from nginx (Debian's, started here on 127.0.0.1 with the same server
// certificate and client-certificate verification), each in its own
// process, and fetches both with the same verifying client in this one:
// the body read, SHA-256 of the container and of every layer compared with
// the known digests. The HTTP/1.1 rows also fetch it from the TLS floor
// (TestTLSFloorProcess): what crypto/tls alone costs for those octets;
// the HTTP/2 rows fetch it from a holder with one P as well.
// Runs alternate peer and holder; each reports its
// throughput and the server's CPU-seconds per GB. Set KVSP_BENCH_NGINX=1
// (make bench-holder does); nginx must be installed.
func BenchmarkVersusNginx(b *testing.B) {
	if os.Getenv("KVSP_BENCH_NGINX") != "1" {
		b.Skip("set KVSP_BENCH_NGINX=1 (make bench-holder)")
	}
	ngx, err := exec.LookPath("nginx")
	if err != nil {
		b.Fatal("nginx not installed")
	}
	data, blk := benchBlockBytes()

	// The holder, in a process of its own; and one whose HTTP/2 is
	// net/http's, for HTTP/2's rows (what internal/h2 replaced).
	hp := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1")
	holderURL, pem := hp.URL, hp.Path
	np := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_HOLDER_NETHTTP2=1")
	fp := kvsptest.StartProcess(b, "TestTLSFloorProcess", "KVSP_TLS_FLOOR="+filepath.Dir(pem("ca.pem")))
	// And the holder with one P (GOMAXPROCS=1), for HTTP/2's rows: what
	// the Go scheduler's wake-ups across Ps cost when one connection
	// idles between the client's WINDOW_UPDATEs.
	op := kvsptest.StartProcess(b, "TestHolderServerProcess", "KVSP_HOLDER_SERVER=1", "KVSP_HOLDER_ONE_P=1")

	// nginx: same certificate, client certificates required.
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
	defer func() { cmd.Process.Signal(syscall.SIGQUIT); cmd.Wait() }()
	for i := 0; i < 100; i++ {
		if c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port)); err == nil {
			c.Close()
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	pids := map[string]int{"holder": hp.Pid, "nginx": cmd.Process.Pid, "holder-nethttp2": np.Pid, "tls-floor": fp.Pid, "holder-1p": op.Pid}

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
	urls := map[string]string{"holder": holderURL, "nginx": "https://127.0.0.1:" + strconv.Itoa(port) + "/block", "holder-nethttp2": np.URL, "tls-floor": fp.URL, "holder-1p": op.URL}
	for _, proto := range []string{"http1", "h2"} {
		for _, clients := range []int{1, 8} {
			for _, peer := range []string{"nginx", "holder", "holder-nethttp2", "holder-1p", "tls-floor"} {
				if (peer == "holder-nethttp2" || peer == "holder-1p") && proto != "h2" {
					continue // the same server as holder's over HTTP/1.1; one P, HTTP/2's question
				}
				if peer == "tls-floor" && proto != "http1" {
					continue // it speaks HTTP/1.1 only
				}
				b.Run(fmt.Sprintf("%s/clients=%d/%s", proto, clients, peer), func(b *testing.B) {
					proc := hp // nginx and the floor have hp's certificate
					switch peer {
					case "holder-nethttp2":
						proc = np
					case "holder-1p":
						proc = op
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
					work := make(chan struct{})
					var wg sync.WaitGroup
					for i := 0; i < clients; i++ {
						wg.Add(1)
						go func() {
							defer wg.Done()
							body := make([]byte, len(data))
							for range work {
								resp, err := c.Get(urls[peer])
								if err != nil {
									b.Error(err)
									return
								}
								if resp.StatusCode != 200 {
									msg, _ := io.ReadAll(resp.Body)
									resp.Body.Close()
									b.Errorf("%s: %d %s", peer, resp.StatusCode, msg)
									return
								}
								_, err = io.ReadFull(resp.Body, body)
								resp.Body.Close()
								if err != nil || verify(body) != nil {
									b.Errorf("%s: %v %v", peer, err, verify(body))
									return
								}
							}
						}()
					}
					meter := kvsptest.NewCPUMeter(pids[peer])
					meter.Start()
					for i := 0; i < b.N; i++ {
						work <- struct{}{}
					}
					close(work)
					wg.Wait()
					meter.Stop()
					b.ReportMetric(meter.Peers.Seconds()/(float64(b.N)*float64(len(data))/1e9), "server-cpu-s/GB")
				})
			}
		}
	}
}
