package kvsptest

import (
	"context"
	"crypto/tls"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvsp/kvsp/internal/pki"
)

// Etcd is a single-member etcd server on loopback.
type Etcd struct {
	Endpoint string
	// TLS is the client configuration its clients need (nil: plain).
	TLS  *tls.Config
	t    testing.TB
	cmd  *exec.Cmd
	args []string
	dir  string
}

func requireEtcd(t testing.TB) string {
	p, err := exec.LookPath("etcd")
	if err != nil {
		if os.Getenv("KVSP_REQUIRE_ETCD") == "1" {
			t.Fatal("etcd not found (make installs it: apt-get install etcd-server)")
		}
		t.Skip("etcd not installed")
	}
	return p
}

// EtcdTLS are the files of an etcd that requires TLS with client
// certificates (client-cert-auth) signed by CA.
type EtcdTLS struct{ Cert, Key, CA string }

// StartEtcd starts etcd with its data in a temporary directory, over TLS
// with client certificates when files are given; clientTLS is how its
// clients connect (nil: plain).
func StartEtcd(t testing.TB, files *EtcdTLS, clientTLS *tls.Config) *Etcd {
	return startEtcdWith(t, files, clientTLS)
}

func startEtcdWith(t testing.TB, files *EtcdTLS, clientTLS *tls.Config) *Etcd {
	bin := requireEtcd(t)
	dir := t.TempDir()
	cport, pport := freePort(t), freePort(t)
	scheme := "http"
	e := &Etcd{t: t, dir: dir, TLS: clientTLS}
	var tlsArgs []string
	if files != nil {
		scheme = "https"
		tlsArgs = []string{"--cert-file", files.Cert, "--key-file", files.Key, "--client-cert-auth", "--trusted-ca-file", files.CA}
	}
	client := scheme + "://127.0.0.1:" + strconv.Itoa(cport)
	peer := "http://127.0.0.1:" + strconv.Itoa(pport)
	e.Endpoint = client
	e.args = append([]string{"--name", "kvsp-test", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "kvsp-test=" + peer,
		"--logger", "zap", "--log-outputs", filepath.Join(dir, "etcd.log"), "--log-level", "warn"}, tlsArgs...)
	e.start(bin)
	t.Cleanup(e.Kill)
	return e
}

// StartEtcdPKI starts etcd over TLS with a server certificate of p's CA
// for 127.0.0.1; e.TLS presents id's certificate.
func StartEtcdPKI(t testing.TB, p *PKI, id string) *Etcd {
	srv := p.Issue(pki.LeafOptions{IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, DNSNames: []string{"localhost"}})
	p.WriteLeaf("etcd.pem", "etcd-key.pem", srv)
	tc := p.ClientTLS(p.Leaf(id))
	tc.NextProtos = []string{"h2"}
	return startEtcdWith(t, &EtcdTLS{Cert: p.Path("etcd.pem"), Key: p.Path("etcd-key.pem"), CA: p.Path("ca.pem")}, tc)
}

func (e *Etcd) start(bin string) {
	e.t.Helper()
	e.cmd = exec.Command(bin, e.args...)
	e.cmd.Dir = e.dir
	if err := e.cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{e.Endpoint}, TLS: e.TLS, DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		e.t.Fatal(err)
	}
	defer cli.Close()
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		_, err := cli.Get(ctx, "/health-check")
		cancel()
		if err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	log, _ := os.ReadFile(filepath.Join(e.dir, "etcd.log"))
	e.t.Fatalf("etcd on %s did not answer; its log:\n%s", e.Endpoint, log)
}

// Kill stops the server with SIGKILL.
func (e *Etcd) Kill() {
	if e.cmd != nil && e.cmd.Process != nil {
		e.cmd.Process.Signal(syscall.SIGKILL)
		e.cmd.Wait()
		e.cmd = nil
	}
}
