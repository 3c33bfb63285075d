package holder_test

import (
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// BenchmarkVersusNginx serves the same 2 MiB container from the holder and
// from nginx (Debian's, started here on 127.0.0.1 with the same server
// certificate and client-certificate verification), and fetches both with
// the same verifying client: the body read, SHA-256 of the container and
// of every layer compared with the known digests. Runs alternate peer and
// holder. Set KVSP_BENCH_NGINX=1 (make bench-holder does); nginx must be
// installed.
func BenchmarkVersusNginx(b *testing.B) {
	if os.Getenv("KVSP_BENCH_NGINX") != "1" {
		b.Skip("set KVSP_BENCH_NGINX=1 (make bench-holder)")
	}
	ngx, err := exec.LookPath("nginx")
	if err != nil {
		b.Fatal("nginx not installed")
	}
	bf := newBenchFixture(b, 1)
	p, srv, data, blk, ref := bf.pki, bf.srv, bf.data, bf.blk, bf.refs[0]

	// nginx: same certificate, client certificates required.
	dir := b.TempDir()
	os.WriteFile(filepath.Join(dir, "block"), data, 0o644)
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
`, dir, port, p.Path("server.pem"), p.Path("server.key"), p.Path("ca.pem"))
	os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(conf), 0o644)
	cmd := exec.Command(ngx, "-c", filepath.Join(dir, "nginx.conf"), "-p", dir)
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
	urls := map[string]string{
		"holder": srv.URL("/h1/blocks/" + ref.Compat.String() + "/" + ref.Scope.String() + "/" + ref.Key.String()),
		"nginx":  "https://127.0.0.1:" + strconv.Itoa(port) + "/block",
	}
	for _, proto := range []string{"http1", "h2"} {
		for _, clients := range []int{1, 8} {
			for _, peer := range []string{"nginx", "holder"} {
				b.Run(fmt.Sprintf("%s/clients=%d/%s", proto, clients, peer), func(b *testing.B) {
					tls := p.ClientTLS(p.Leaf(kvsptest.ClientA))
					if proto == "http1" {
						tls.NextProtos = []string{"http/1.1"}
					}
					tr := &http.Transport{TLSClientConfig: tls, ForceAttemptHTTP2: proto == "h2", MaxIdleConnsPerHost: 16,
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
					for i := 0; i < b.N; i++ {
						work <- struct{}{}
					}
					close(work)
					wg.Wait()
				})
			}
		}
	}
}
