package kvsptest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RedisPassword is the password of test Redis servers (the tests use
// authentication, as deployments must).
const RedisPassword = "kvsp-test-password"

// Redis is a real redis-server subprocess on loopback.
type Redis struct {
	t    testing.TB
	Addr string
	Port int
	dir  string
	args []string
	cmd  *exec.Cmd
}

// requireRedis skips, or fails when KVSP_REQUIRE_REDIS=1 (make test sets
// it: the Makefile installs redis-server), when redis-server is missing.
func requireRedis(t testing.TB) string {
	p, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("KVSP_REQUIRE_REDIS") == "1" {
			t.Fatal("redis-server not found (make installs it: apt-get install redis-server)")
		}
		t.Skip("redis-server not installed")
	}
	return p
}

func freePort(t testing.TB) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// StartRedis starts a password-protected redis-server without persistence;
// extra arguments are appended (cluster mode). It is killed when the test
// ends.
func StartRedis(t testing.TB, extra ...string) *Redis {
	bin := requireRedis(t)
	port := freePort(t)
	r := &Redis{t: t, Port: port, Addr: "127.0.0.1:" + strconv.Itoa(port), dir: t.TempDir()}
	r.args = append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--requirepass", RedisPassword,
		"--masterauth", RedisPassword, "--save", "", "--appendonly", "no", "--dir", r.dir, "--daemonize", "no"}, extra...)
	r.start(bin)
	t.Cleanup(r.Kill)
	return r
}

func (r *Redis) start(bin string) {
	r.t.Helper()
	r.cmd = exec.Command(bin, r.args...)
	r.cmd.Dir = r.dir
	if err := r.cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if r.ping() == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	r.t.Fatalf("redis-server on %s did not answer", r.Addr)
}

// ping sends AUTH and PING over RESP.
func (r *Redis) ping() error {
	c, err := net.DialTimeout("tcp", r.Addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Second))
	fmt.Fprintf(c, "AUTH %s\r\nPING\r\n", RedisPassword)
	br := bufio.NewReader(c)
	for _, want := range []string{"+OK", "+PONG"} {
		line, err := br.ReadString('\n')
		if err != nil {
			return err
		}
		if !strings.HasPrefix(line, want) {
			return fmt.Errorf("redis: %q", line)
		}
	}
	return nil
}

// Pid returns the server's process id (0 when it is not running).
func (r *Redis) Pid() int {
	if r.cmd == nil || r.cmd.Process == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// Kill stops the server with SIGKILL (a crash: nothing is saved).
func (r *Redis) Kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		r.cmd.Process.Signal(syscall.SIGKILL)
		r.cmd.Wait()
		r.cmd = nil
	}
}

// Restart starts the server again on the same port, empty.
func (r *Redis) Restart() {
	r.Kill()
	r.start(requireRedis(r.t))
}

// StartRedisCluster starts n cluster-enabled servers and joins them into a
// Redis Cluster with redis-cli (no replicas); it returns their addresses.
func StartRedisCluster(t testing.TB, n int) []string {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		if os.Getenv("KVSP_REQUIRE_REDIS") == "1" {
			t.Fatal("redis-cli not found (make installs redis-tools)")
		}
		t.Skip("redis-cli not installed")
	}
	var addrs []string
	for i := 0; i < n; i++ {
		r := StartRedis(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		addrs = append(addrs, r.Addr)
	}
	args := append([]string{"-a", RedisPassword, "--no-auth-warning", "--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	// Wait until every node reports the cluster as ok.
	deadline := time.Now().Add(15 * time.Second)
	for _, a := range addrs {
		host, port, _ := net.SplitHostPort(a)
		for {
			out, _ := exec.Command(cli, "-h", host, "-p", port, "-a", RedisPassword, "--no-auth-warning", "cluster", "info").Output()
			if strings.Contains(string(out), "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cluster not ok on %s: %s", a, out)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return addrs
}
