package tier

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
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

// TestDiskDetectsTampering: a flipped bit, a file moved to another block's
// name, and a deleted data key all read as ErrCorrupt, never as data.
func TestDiskDetectsTampering(t *testing.T) {
	dir := t.TempDir()
	d, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	d.Put(name(1), block(t, 1))
	d.Put(name(2), block(t, 2))
	p := d.path(name(1))
	raw, _ := os.ReadFile(p)
	for _, off := range []int{len(raw) - 1, len(raw) / 2, len(fileMagic) + 6} {
		bad := bytes.Clone(raw)
		bad[off] ^= 0x01
		os.WriteFile(p, bad, 0o600)
		if _, err := d.Get(name(1), geom); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("bit flipped at %d: %v", off, err)
		}
	}
	os.WriteFile(p, raw[:len(raw)-10], 0o600)
	if _, err := d.Get(name(1), geom); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("truncated: %v", err)
	}
	other, _ := os.ReadFile(d.path(name(2)))
	os.WriteFile(p, other, 0o600) // block 2's file under block 1's name
	if _, err := d.Get(name(1), geom); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("moved file: %v", err)
	}
	// Crypto-shredding: without the scope's wrapped data key, nothing reads.
	os.Remove(filepath.Join(dir, "keys", name(2).Scope.String()))
	d2, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if _, err := d2.Get(name(2), geom); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("deleted data key: %v", err)
	}
}

// TestDiskCrashLeavesNothing: the temporary file of an interrupted write is
// removed at the next start, and a rewrite never exposes a half file.
func TestDiskCrashLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	d, _ := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	d.Put(name(1), block(t, 1))
	half := filepath.Join(filepath.Dir(d.path(name(1))), tmpPrefix+"crash")
	os.WriteFile(half, []byte("KVSPDSK1 half written"), 0o600)
	d2, err := OpenDisk(DiskConfig{Dir: dir, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(half); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("temporary file of a crashed write survived the restart")
	}
	if len(d2.List()) != 1 {
		t.Fatalf("blocks after restart: %v", d2.List())
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
