package tier

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
	"github.com/kvsp/kvsp/internal/figures"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var geom = container.Geometry{Layers: 4, BlockTokens: 2, KVHeads: 1, HeadDim: 8, Elem: container.FP16}

func block(t *testing.T, seed byte) *container.Block {
	h, _ := container.NewHeader(container.CodecRaw, 0, 4, geom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	for i := 0; i < 4; i++ {
		s := bytes.Repeat([]byte{seed + byte(i)}, int(geom.RawSectionLen()))
		w.WriteLayer(s, s)
	}
	w.Close()
	b, err := container.OpenBlock(buf.Bytes(), geom)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func name(k byte) Name {
	return Name{Compat: kvsp.CompatID{1}, Scope: kvsp.ScopeID{2}, Key: kvsp.BlockKey{k}}
}

// TestDiskRoundTripAndRestart: a stored block reads back identical, also
// after reopening the tier; nothing of it is stored in clear.
func TestDiskRoundTripAndRestart(t *testing.T) {
	dir := t.TempDir()
	d, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "master.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("generated master key: %v %v", fi, err)
	}
	b := block(t, 0x40)
	if err := d.Put(name(1), b); err != nil {
		t.Fatal(err)
	}
	raw, _ := os.ReadFile(d.path(name(1)))
	if bytes.Contains(raw, bytes.Repeat([]byte{0x41}, 16)) {
		t.Fatal("layer data stored in clear")
	}
	d2, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if got := d2.List(); len(got) != 1 || got[0] != name(1) {
		t.Fatalf("after restart: %v", got)
	}
	g, err := d2.Get(name(1), geom)
	if err != nil || !bytes.Equal(g.Bytes(), b.Bytes()) || g.ContainerDigest() != b.ContainerDigest() {
		t.Fatalf("read back: %v", err)
	}
	if _, err := d2.Get(name(9), geom); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("missing block: %v", err)
	}
}

// s10Geom has 128-octet sections: two 64-octet plaintext patterns each.
var s10Geom = container.Geometry{Layers: 4, BlockTokens: 4, KVHeads: 2, HeadDim: 8, Elem: container.FP16}

// randomBlock is a block of s10Geom with random sections.
func randomBlock(t *testing.T, rng *rand.Rand) *container.Block {
	h, _ := container.NewHeader(container.CodecRaw, 0, 4, s10Geom)
	var buf bytes.Buffer
	w := container.NewWriter(&buf, h)
	for range 4 {
		k, v := make([]byte, s10Geom.RawSectionLen()), make([]byte, s10Geom.RawSectionLen())
		for i := range k {
			k[i], v[i] = byte(rng.Uint32()), byte(rng.Uint32())
		}
		w.WriteLayer(k, v)
	}
	w.Close()
	b, err := container.OpenBlock(buf.Bytes(), s10Geom)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestS10_EncryptionAtRest (RELIABILITY S10; formerly
// TestDiskDetectsTampering): blocks of two scopes A and B are written
// (KVSP_S10_BLOCKS of them, default 600; the row's run is 10000), then
// the storage directory is scanned: no 64-octet plaintext pattern of any
// K or V section is found in any file, and every nonce (of each sealed
// layer and each wrapped data key) is unique. A flipped bit, a
// truncation, two files of a scope swapped, a file moved to the other
// scope, and two layers swapped within a file all read as ErrCorrupt,
// never as data. Once scope A's wrapped data key (KEK_A) is deleted, none
// of A's blocks reads, and every one of B's still does.
func TestS10_EncryptionAtRest(t *testing.T) {
	n := 600
	if v := os.Getenv("KVSP_S10_BLOCKS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 4 {
			t.Fatalf("KVSP_S10_BLOCKS=%q", v)
		}
	}
	dir := t.TempDir()
	d, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	scopeA, scopeB := kvsp.ScopeID{0xa}, kvsp.ScopeID{0xb}
	nameOf := func(i int) Name {
		n := Name{Compat: kvsp.CompatID{1}, Scope: scopeA, Key: kvsp.BlockKey{byte(i), byte(i >> 8), byte(i >> 16)}}
		if i%2 == 1 {
			n.Scope = scopeB
		}
		return n
	}
	rng := rand.New(rand.NewPCG(10, 10))
	blocks := make([]*container.Block, n)
	patterns := map[[64]byte]int{}
	for i := range blocks {
		blocks[i] = randomBlock(t, rng)
		data := blocks[i].Bytes()[blocks[i].Header().Len():]
		for off := 0; off+64 <= len(data); off += 64 {
			patterns[[64]byte(data[off:off+64])] = i
		}
		if err := d.Put(nameOf(i), blocks[i]); err != nil {
			t.Fatal(err)
		}
	}
	// The scan: every file of the directory, every 64-octet window.
	nonces := map[string]string{}
	files := 0
	filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		raw, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		files++
		for off := 0; off+64 <= len(raw); off++ {
			if i, ok := patterns[[64]byte(raw[off:off+64])]; ok {
				t.Fatalf("%s holds 64 octets of block %d in clear, at %d", p, i, off)
			}
		}
		nonce := func(b []byte) {
			if prev, ok := nonces[string(b)]; ok {
				t.Fatalf("nonce %x used twice: %s and %s", b, prev, p)
			}
			nonces[string(b)] = p
		}
		switch filepath.Base(filepath.Dir(p)) {
		case "keys": // a wrapped data key: nonce, sealed key
			nonce(raw[:12])
		case scopeA.String(), scopeB.String(): // a block: magic, header length, header, then per layer nonce and sealed layer
			hl := int(binary.BigEndian.Uint32(raw[len(fileMagic):]))
			rest := raw[len(fileMagic)+4+hl:]
			for range 4 {
				nonce(rest[:12])
				rest = rest[12+2*s10Geom.RawSectionLen()+16:]
			}
			if len(rest) != 0 {
				t.Fatalf("%s: %d octets after the last layer", p, len(rest))
			}
		}
		return nil
	})
	if want := 4*n + 2; len(nonces) != want || files != n+3 {
		t.Fatalf("%d nonces in %d files, want %d in %d", len(nonces), files, want, n+3)
	}

	// Tampering, on scope A's blocks 0, 2, 4 and 6.
	corrupt := func(what string, i int) {
		t.Helper()
		if _, err := d.Get(nameOf(i), s10Geom); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("%s: block %d read as %v", what, i, err)
		}
	}
	p0, p2 := d.path(nameOf(0)), d.path(nameOf(2))
	raw0, _ := os.ReadFile(p0)
	raw2, _ := os.ReadFile(p2)
	for _, off := range []int{len(raw0) - 1, len(raw0) / 2, len(fileMagic) + 6} {
		bad := bytes.Clone(raw0)
		bad[off] ^= 0x01
		os.WriteFile(p0, bad, 0o600)
		corrupt(fmt.Sprintf("a bit flipped at %d", off), 0)
	}
	os.WriteFile(p0, raw0[:len(raw0)-10], 0o600)
	corrupt("truncated", 0)
	os.WriteFile(p0, raw2, 0o600) // two files of scope A swapped
	os.WriteFile(p2, raw0, 0o600)
	corrupt("swapped", 0)
	corrupt("swapped", 2)
	os.WriteFile(p0, raw0, 0o600)
	if b, err := d.Get(nameOf(0), s10Geom); err != nil || !bytes.Equal(b.Bytes(), blocks[0].Bytes()) {
		t.Fatalf("the file put back: %v", err)
	}
	raw1, _ := os.ReadFile(d.path(nameOf(1))) // scope B's file under scope A's name
	os.WriteFile(d.path(nameOf(4)), raw1, 0o600)
	corrupt("moved across scopes", 4)
	p6 := d.path(nameOf(6))
	raw6, _ := os.ReadFile(p6)
	layer := 12 + 2*int(s10Geom.RawSectionLen()) + 16
	at := len(fileMagic) + 4 + int(binary.BigEndian.Uint32(raw6[len(fileMagic):]))
	swapped := bytes.Clone(raw6)
	copy(swapped[at:], raw6[at+layer:at+2*layer]) // layers 0 and 1 swapped
	copy(swapped[at+layer:], raw6[at:at+layer])
	os.WriteFile(p6, swapped, 0o600)
	corrupt("two layers swapped", 6)

	// Crypto-shredding: without KEK_A, nothing of A reads; B is intact.
	if err := os.Remove(filepath.Join(dir, "keys", scopeA.String())); err != nil {
		t.Fatal(err)
	}
	d2, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 40})
	if err != nil {
		t.Fatal(err)
	}
	for i := range blocks {
		b, err := d2.Get(nameOf(i), s10Geom)
		switch {
		case i%2 == 0 && !errors.Is(err, ErrCorrupt):
			t.Fatalf("scope A's block %d after its key was deleted: %v", i, err)
		case i%2 == 1 && (err != nil || !bytes.Equal(b.Bytes(), blocks[i].Bytes())):
			t.Fatalf("scope B's block %d after A's key was deleted: %v", i, err)
		}
	}
	t.Logf("%d blocks, %d files scanned, %d patterns, %d nonces", n, files, len(patterns), len(nonces))
	figures.Report(t, figures.Row{Row: "S10", Inputs: int64(len(patterns)),
		Held:   fmt.Sprintf("%d blocks at rest: %d plaintext patterns searched in %d files, none found; %d nonces, all distinct; swaps, truncations and a deleted key refused", n, len(patterns), files, len(nonces)),
		Detail: map[string]float64{"blocks": float64(n), "files": float64(files), "patterns": float64(len(patterns)), "nonces": float64(len(nonces))}})
}

// TestDiskWriterProcess is not a test: TestF5_DiskKilledMidWrite runs the
// test binary with it selected, to write block 2 into the tier at
// $KVSP_DISK_WRITER under a failpoint that kills the process.
func TestDiskWriterProcess(t *testing.T) {
	dir := os.Getenv("KVSP_DISK_WRITER")
	if dir == "" {
		t.Skip("the writer process of TestF5_DiskKilledMidWrite")
	}
	d, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	d.Put(name(2), block(t, 2))
	t.Fatal("the write finished: the failpoint did not kill the process")
}

// TestF5_DiskKilledMidWrite (RELIABILITY F5, tier half; formerly
// TestDiskCrashLeavesNothing): a process SIGKILLed (failpoint kill)
// between writing a block's temporary file and its fsync, or between
// the fsync and the rename, leaves that temporary file and no block; the
// next start removes the temporary file, lists and serves only the
// blocks written before, and the block is written again without
// trouble. The holder half is holder.TestF5_HolderKilledMidPUT.
func TestF5_DiskKilledMidWrite(t *testing.T) {
	for _, fp := range []string{"tier/disk-before-fsync", "tier/disk-before-rename"} {
		dir := t.TempDir()
		d, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Put(name(1), block(t, 1)); err != nil { // written before the crash (and the scope's data key)
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-test.run", "^TestDiskWriterProcess$")
		cmd.Env = append(os.Environ(), "KVSP_DISK_WRITER="+dir, failpoint.Env+"="+fp+"=kill")
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("%s: the writer was not killed at the failpoint: %v\n%s", fp, err, out)
		}
		tmps, _ := filepath.Glob(filepath.Join(filepath.Dir(d.path(name(2))), tmpPrefix+"*"))
		if len(tmps) != 1 {
			t.Fatalf("%s: %d temporary files after the crash, want the interrupted one", fp, len(tmps))
		}
		if _, err := os.Stat(d.path(name(2))); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s: the interrupted block is visible: %v", fp, err)
		}
		d2, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(tmps[0]); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("%s: the temporary file survived the restart", fp)
		}
		if l := d2.List(); len(l) != 1 || l[0] != name(1) {
			t.Fatalf("%s: blocks after the restart: %v", fp, l)
		}
		if _, err := d2.Get(name(2), geom); !errors.Is(err, kvsp.ErrNotFound) {
			t.Fatalf("%s: the interrupted block reads as %v", fp, err)
		}
		if b, err := d2.Get(name(1), geom); err != nil || !bytes.Equal(b.Bytes(), block(t, 1).Bytes()) {
			t.Fatalf("%s: the block written before the crash: %v", fp, err)
		}
		if err := d2.Put(name(2), block(t, 2)); err != nil {
			t.Fatalf("%s: writing the block again: %v", fp, err)
		}
		if b, err := d2.Get(name(2), geom); err != nil || !bytes.Equal(b.Bytes(), block(t, 2).Bytes()) {
			t.Fatalf("%s: the block written again: %v", fp, err)
		}
	}
}

func TestDiskCapacityAndKeys(t *testing.T) {
	dir := t.TempDir()
	d, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 700})
	if err := d.Put(name(1), block(t, 1)); err != nil {
		t.Fatal(err)
	}
	if err := d.Put(name(2), block(t, 2)); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("over capacity: %v", err)
	}
	d.Delete(name(1))
	if err := d.Put(name(2), block(t, 2)); err != nil {
		t.Fatalf("after delete: %v", err)
	}
	bad := filepath.Join(t.TempDir(), "k")
	os.WriteFile(bad, []byte("short"), 0o600)
	if _, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Capacity: 1, MasterKeyFile: bad}); err == nil {
		t.Fatal("a short master key accepted")
	}
	if _, err := OpenDisk(DiskConfig{Dir: t.TempDir(), Capacity: 1, MasterKeyFile: filepath.Join(t.TempDir(), "none")}); err == nil {
		t.Fatal("a missing master_key_file was generated instead of refused")
	}
}

// TestDiskWriteFailure: a write that cannot land is an error, not a block.
func TestDiskWriteFailure(t *testing.T) {
	dir := t.TempDir()
	d, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	blocks := filepath.Join(dir, "blocks")
	os.RemoveAll(blocks)
	os.WriteFile(blocks, []byte("not a directory"), 0o600)
	if err := d.Put(name(1), block(t, 1)); err == nil {
		t.Fatal("a failed write reported success")
	}
	if len(d.List()) != 0 {
		t.Fatal("a failed write is listed")
	}
}

// TestPutAllOneFlushForTheBatch: PutAll stores a batch with one flush
// (several files, several scopes' directories), each block read back
// verified and the same after a restart; a block past the capacity is
// refused alone, its room not counted, and its temporary file not left.
func TestPutAllOneFlushForTheBatch(t *testing.T) {
	dir := t.TempDir()
	d, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	one := block(t, 1)
	probe := t.TempDir()
	p, _ := OpenDisk(DiskConfig{Dir: probe, Capacity: 1 << 20})
	p.Put(name(1), one)
	fileSize := p.used
	d.capacity = 3 * fileSize
	other := name(4)
	other.Scope = kvsp.ScopeID{9}
	items := []Item{{name(1), block(t, 1)}, {name(2), block(t, 2)}, {other, block(t, 4)}, {name(3), block(t, 3)}}
	errs := d.PutAll(items)
	for i, err := range errs[:3] {
		if err != nil {
			t.Fatalf("item %d: %v", i, err)
		}
	}
	if !errors.Is(errs[3], kvsp.ErrUnavailable) {
		t.Fatalf("the item past the capacity: %v", errs[3])
	}
	if d.used != 3*fileSize {
		t.Fatalf("%d octets counted, want %d", d.used, 3*fileSize)
	}
	tmps, _ := filepath.Glob(filepath.Join(dir, "blocks", "*", "*", tmpPrefix+"*"))
	if len(tmps) != 0 {
		t.Fatalf("temporary files left: %v", tmps)
	}
	d2, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	for _, it := range items[:3] {
		b, err := d2.Get(it.Name, geom)
		if err != nil || !bytes.Equal(b.Bytes(), it.Block.Bytes()) {
			t.Fatalf("%v after the restart: %v", it.Name.Key, err)
		}
	}
	if _, err := d2.Get(name(3), geom); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("the refused block: %v", err)
	}
}
