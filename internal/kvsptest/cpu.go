package kvsptest

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTick is Linux's USER_HZ, the unit of /proc/<pid>/stat times; it is
// 100 on every architecture Linux exports to user space.
const clockTick = 10 * time.Millisecond

// ProcessCPU returns the user plus system CPU time consumed so far by the
// process pid (Linux /proc), so a benchmark can charge a peer process
// (redis-server, nginx, a server subprocess) its share of the work.
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) may contain spaces: fields count from
	// the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("kvsptest: malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("kvsptest: malformed /proc/%d/stat", pid)
	}
	// After ')': state(3) ... utime(14) stime(15), so indexes 11 and 12.
	ut, err1 := strconv.ParseUint(f[11], 10, 64)
	st, err2 := strconv.ParseUint(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("kvsptest: malformed /proc/%d/stat", pid)
	}
	return time.Duration(ut+st) * clockTick, nil
}

// SelfCPU returns the user plus system CPU time of this process.
func SelfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// CPUMeter measures the CPU time of this process and of peer processes
// (with their children) between Start and Stop.
type CPUMeter struct {
	pids        []int
	self0       time.Duration
	peers0      []time.Duration
	Self, Peers time.Duration
}

// NewCPUMeter measures this process and the given peers.
func NewCPUMeter(peers ...int) *CPUMeter { return &CPUMeter{pids: peers} }

// Start records the starting times.
func (m *CPUMeter) Start() {
	m.self0 = SelfCPU()
	m.peers0 = m.peers0[:0]
	for _, p := range m.pids {
		c, _ := ProcessTreeCPU(p)
		m.peers0 = append(m.peers0, c)
	}
}

// Stop records the CPU consumed since Start into Self and Peers.
func (m *CPUMeter) Stop() {
	m.Self = SelfCPU() - m.self0
	m.Peers = 0
	for i, p := range m.pids {
		c, _ := ProcessTreeCPU(p)
		m.Peers += c - m.peers0[i]
	}
}

// ProcessTreeCPU is ProcessCPU of pid plus that of its children (nginx's
// workers under its master), found through /proc/<pid>/task/*/children.
func ProcessTreeCPU(pid int) (time.Duration, error) {
	total, err := ProcessCPU(pid)
	if err != nil {
		return 0, err
	}
	for _, c := range children(pid) {
		if d, err := ProcessTreeCPU(c); err == nil {
			total += d
		}
	}
	return total, nil
}

// children lists the processes whose parent is pid
// (/proc/<pid>/task/*/children).
func children(pid int) []int {
	var out []int
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, t.Name()))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out
}

// ProcCounts is what Linux counts for a process tree: write and read
// system calls (/proc/<pid>/io's syscw and syscr, its threads' and its
// exited threads') and its live threads' context switches, voluntary and
// not (/proc/<pid>/task/*/status).
type ProcCounts struct{ Writes, Reads, Switches int64 }

// ProcessTreeCounts is ProcCounts for pid and its children, found as
// ProcessTreeCPU finds them.
func ProcessTreeCounts(pid int) (ProcCounts, error) {
	var c ProcCounts
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return c, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, _ := strings.Cut(l, ": ")
		n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		switch k {
		case "syscw":
			c.Writes = n
		case "syscr":
			c.Reads = n
		}
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	for _, t := range tasks {
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name())); err == nil {
			for _, l := range strings.Split(string(b), "\n") {
				if k, v, ok := strings.Cut(l, ":"); ok && strings.HasSuffix(k, "ctxt_switches") {
					n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
					c.Switches += n
				}
			}
		}
	}
	for _, child := range children(pid) {
		if cc, err := ProcessTreeCounts(child); err == nil {
			c.Writes += cc.Writes
			c.Reads += cc.Reads
			c.Switches += cc.Switches
		}
	}
	return c, nil
}
