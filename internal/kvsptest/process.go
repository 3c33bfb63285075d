package kvsptest

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
)

// Benchmarks that compare a server's CPU time with a peer's run the server
// in a process of its own: the test binary, with one test selected that
// serves (ServeFromProcess) while the benchmark loads it (StartProcess).

// ServeFromProcess is the serving side: it announces url and the PKI
// directory (where client.pem/client.key of a client identity must be) to
// the parent, optionally profiles the process into the file named by the
// environment variable profileEnv, and serves until the parent closes
// stdin.
func ServeFromProcess(t testing.TB, url string, p *PKI, profileEnv string) {
	runtime.GC()
	if prof := os.Getenv(profileEnv); prof != "" && profileEnv != "" {
		f, err := os.Create(prof)
		if err != nil {
			t.Fatal(err)
		}
		pprof.StartCPUProfile(f)
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	fmt.Printf("\nSERVING %s %s\n", url, p.Dir)
	io.Copy(io.Discard, os.Stdin) // until the parent closes it
}

// Process is a server running in a subprocess.
type Process struct {
	URL    string // what it serves
	Pid    int
	dir    string
	close  func()
	exited chan struct{}
}

// Exited is closed when the process has ended, whatever ended it.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Close ends the process (the test's end does too).
func (p *Process) Close() { p.close() }

// StartProcess runs the test binary with test selected and env added, and
// waits for it to serve; the process ends with the test.
func StartProcess(t testing.TB, test string, env ...string) *Process {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run", "^"+test+"$", "-test.v")
	cmd.Env = append(os.Environ(), env...)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	var once sync.Once
	stop := func() { once.Do(func() { stdin.Close(); <-exited }) }
	t.Cleanup(stop)
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "SERVING" {
			go io.Copy(io.Discard, stdout)
			return &Process{URL: f[1], Pid: cmd.Process.Pid, dir: f[2], close: stop, exited: exited}
		}
	}
	t.Fatalf("%s did not start serving", test)
	return nil
}

// Path returns a file of the process's PKI directory.
func (p *Process) Path(name string) string { return filepath.Join(p.dir, name) }

// ClientTLS is a TLS 1.3 configuration trusting the process's CA and
// presenting its client.pem, offering protos.
func (p *Process) ClientTLS(t testing.TB, protos ...string) *tls.Config {
	t.Helper()
	ca, err := os.ReadFile(p.Path("ca.pem"))
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.LoadX509KeyPair(p.Path("client.pem"), p.Path("client.key"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	return &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: pool, Certificates: []tls.Certificate{cert}, NextProtos: protos}
}
