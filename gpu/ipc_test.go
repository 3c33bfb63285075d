package gpu

import (
	"bytes"
	"encoding/hex"
	"os"
	"os/exec"
	"syscall"
	"testing"
)

// TestIPCAcrossProcesses: a buffer exported by one process (an engine's KV
// pool) is imported by another (the holder, the agent): the child sees the
// parent's octets, and the parent sees what the child writes. CUDA IPC
// handles cannot be opened by their exporter, so the importer is a real
// child process; the stand-in's memfd travels to it as a file descriptor.
func TestIPCAcrossProcesses(t *testing.T) {
	d := openDevice(t)
	const n = 1 << 20
	b, err := d.AllocShared(n)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	data := random(n, 7)
	if err := b.CopyIn(0, data); err != nil {
		t.Fatal(err)
	}
	h, err := b.Export()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestIPCChild$", "-test.v")
	cmd.Env = append(os.Environ(), "KVSP_IPC_CHILD=1", "KVSP_IPC_HANDLE="+hex.EncodeToString(h.CUDA[:]))
	if h.FD >= 0 {
		dup, err := syscall.Dup(h.FD) // the child's copy: the buffer keeps its own
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(dup), "pool")
		defer f.Close()
		cmd.ExtraFiles = []*os.File{f} // fd 3 in the child
		cmd.Env = append(cmd.Env, "KVSP_IPC_FD=3")
	}
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestIPCChild")) {
		t.Fatalf("child: %v\n%s", err, out)
	}
	got := make([]byte, 64)
	if err := b.CopyOut(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{0xc3}, 64)) {
		t.Fatalf("the child's write is not visible to the exporter: %v", err)
	}
	if _, err := b.Export(); err != nil {
		t.Fatalf("export again: %v", err)
	}
	plain, _ := d.Alloc(4096)
	defer plain.Free()
	if d.IPCKind() == IPCMemfd {
		if _, err := plain.Export(); err == nil {
			t.Fatal("a buffer not allocated shared was exported")
		}
	}
}

// TestIPCChild is the importing process of TestIPCAcrossProcesses.
func TestIPCChild(t *testing.T) {
	if os.Getenv("KVSP_IPC_CHILD") != "1" {
		t.Skip("the child of TestIPCAcrossProcesses")
	}
	d := openDevice(t)
	var h IPCHandle
	h.FD = -1
	raw, _ := hex.DecodeString(os.Getenv("KVSP_IPC_HANDLE"))
	copy(h.CUDA[:], raw)
	if os.Getenv("KVSP_IPC_FD") == "3" {
		h.FD = 3
	}
	b, err := d.Import(h, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	got := make([]byte, 1<<20)
	if err := b.CopyOut(got, 0); err != nil || !bytes.Equal(got, random(1<<20, 7)) {
		t.Fatalf("imported octets differ: %v", err)
	}
	if err := b.CopyIn(0, bytes.Repeat([]byte{0xc3}, 64)); err != nil {
		t.Fatal(err)
	}
}
