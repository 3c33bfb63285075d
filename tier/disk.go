// Package tier holds the storage tiers of a holder beyond its host memory.
//
// Disk is the "local-storage" tier: one file per block, written atomically
// (temporary file, fsync, rename, fsync of the directory), so a crash in
// the middle of a write leaves nothing behind, and encrypted at rest:
// every layer is sealed with AES-256-GCM under a random data key of the
// block's scope, with associated data that binds the compat_id, scope_id,
// block key, layer number and the container header. Each scope's data key
// is stored wrapped (AES-256-GCM) by the holder's master key; deleting a
// scope's wrapped key makes all of its blocks unreadable. The scope key of
// KVSP never reaches this package.
package tier

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/failpoint"
)

// Name is a block's identity in a tier.
type Name struct {
	Compat kvsp.CompatID
	Scope  kvsp.ScopeID
	Key    kvsp.BlockKey
}

// ErrCorrupt: a stored block failed authentication (a flipped bit, a
// truncated file, a missing data key). The holder drops it and withdraws
// its record.
var ErrCorrupt = errors.New("tier: stored block failed authentication")

// DiskConfig configures a Disk tier.
type DiskConfig struct {
	Dir      string
	Capacity int64
	// MasterKeyFile holds 32 random octets. When empty, Dir/master.key is
	// used, created (mode 0600) on first start with a warning: a key next
	// to the data protects against less.
	MasterKeyFile string
	Logger        *slog.Logger
}

// Disk is the local-storage tier.
type Disk struct {
	dir      string
	capacity int64
	master   cipher.AEAD

	mu   sync.Mutex
	used int64
	keys map[kvsp.ScopeID]cipher.AEAD
	size map[Name]int64
	bufs fileBuffers
}

// fileBuffers recycles the buffers blocks are sealed into: a fresh one a
// block (zeroed, then collected) cost as much as the copy into it. One
// larger than maxPooledFile is not kept.
type fileBuffers struct{ p sync.Pool }

const maxPooledFile = 64 << 20

func (f *fileBuffers) Get(n int) *[]byte {
	if b, ok := f.p.Get().(*[]byte); ok && cap(*b) >= n {
		return b
	}
	b := make([]byte, 0, n)
	return &b
}

func (f *fileBuffers) Put(b *[]byte) {
	if cap(*b) <= maxPooledFile {
		*b = (*b)[:0]
		f.p.Put(b)
	}
}

const (
	fileMagic = "KVSPDSK1"
	tmpPrefix = ".tmp-"
)

func newGCM(key []byte) (cipher.AEAD, error) {
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

// OpenDisk opens (creating) the tier's directory, removes the temporary
// files of writes a crash interrupted, and accounts the blocks present.
func OpenDisk(cfg DiskConfig) (*Disk, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Capacity <= 0 {
		return nil, errors.New("tier: local-storage: capacity required")
	}
	for _, d := range []string{cfg.Dir, filepath.Join(cfg.Dir, "blocks"), filepath.Join(cfg.Dir, "keys")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("tier: local-storage: %w", err)
		}
	}
	mk, err := loadMasterKey(cfg)
	if err != nil {
		return nil, err
	}
	master, err := newGCM(mk)
	if err != nil {
		return nil, err
	}
	d := &Disk{dir: cfg.Dir, capacity: cfg.Capacity, master: master, keys: map[kvsp.ScopeID]cipher.AEAD{}, size: map[Name]int64{}}
	err = filepath.WalkDir(filepath.Join(cfg.Dir, "blocks"), func(p string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return err
		}
		if strings.HasPrefix(e.Name(), tmpPrefix) {
			return os.Remove(p) // an interrupted write: nothing is left of it
		}
		n, ok := d.nameOf(p)
		if !ok {
			return nil
		}
		fi, err := e.Info()
		if err != nil {
			return err
		}
		d.size[n] = fi.Size()
		d.used += fi.Size()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("tier: local-storage: %w", err)
	}
	return d, nil
}

func loadMasterKey(cfg DiskConfig) ([]byte, error) {
	path := cfg.MasterKeyFile
	if path == "" {
		path = filepath.Join(cfg.Dir, "master.key")
	}
	k, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) && cfg.MasterKeyFile == "" {
		k = make([]byte, 32)
		if _, err := io.ReadFull(rand.Reader, k); err != nil {
			return nil, err
		}
		if err := os.WriteFile(path, k, 0o600); err != nil {
			return nil, fmt.Errorf("tier: local-storage: master key: %w", err)
		}
		cfg.Logger.Warn("generated a master key next to the data; set master_key_file to keep it elsewhere", "path", path)
		return k, nil
	}
	if err != nil {
		return nil, fmt.Errorf("tier: local-storage: master key: %w", err)
	}
	if len(k) != 32 {
		return nil, fmt.Errorf("tier: local-storage: master key %s must be 32 octets", path)
	}
	return k, nil
}

func (d *Disk) path(n Name) string {
	return filepath.Join(d.dir, "blocks", n.Compat.String(), n.Scope.String(), n.Key.String())
}

func (d *Disk) nameOf(p string) (Name, bool) {
	rel, err := filepath.Rel(filepath.Join(d.dir, "blocks"), p)
	if err != nil {
		return Name{}, false
	}
	parts := strings.Split(filepath.ToSlash(rel), "/")
	if len(parts) != 3 {
		return Name{}, false
	}
	var n Name
	if n.Compat, err = kvsp.ParseCompatID(parts[0]); err != nil {
		return Name{}, false
	}
	if n.Scope, err = kvsp.ParseScopeID(parts[1]); err != nil {
		return Name{}, false
	}
	if n.Key, err = kvsp.ParseBlockKey(parts[2]); err != nil {
		return Name{}, false
	}
	return n, true
}

// dataKey returns the scope's data key, creating and wrapping a new one
// on first use.
func (d *Disk) dataKey(s kvsp.ScopeID, create bool) (cipher.AEAD, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if k := d.keys[s]; k != nil {
		return k, nil
	}
	p := filepath.Join(d.dir, "keys", s.String())
	ad := []byte("kvsp-data-key|" + s.String())
	wrapped, err := os.ReadFile(p)
	var key []byte
	switch {
	case err == nil:
		ns := d.master.NonceSize()
		if len(wrapped) < ns {
			return nil, ErrCorrupt
		}
		if key, err = d.master.Open(nil, wrapped[:ns], wrapped[ns:], ad); err != nil {
			return nil, ErrCorrupt
		}
	case errors.Is(err, fs.ErrNotExist) && create:
		key = make([]byte, 32)
		nonce := make([]byte, d.master.NonceSize())
		if _, err := io.ReadFull(rand.Reader, key); err != nil {
			return nil, err
		}
		if _, err := io.ReadFull(rand.Reader, nonce); err != nil {
			return nil, err
		}
		if err := writeAtomic(p, append(nonce, d.master.Seal(nil, nonce, key, ad)...)); err != nil {
			return nil, err
		}
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("%w: the scope's data key is gone", ErrCorrupt)
	default:
		return nil, err
	}
	k, err := newGCM(key)
	if err != nil {
		return nil, err
	}
	d.keys[s] = k
	return k, nil
}

func layerAD(n Name, layer uint32, hdr []byte) []byte {
	return appendLayerAD(make([]byte, 0, 32+16+32+4+len(hdr)), n, layer, hdr)
}

func appendLayerAD(ad []byte, n Name, layer uint32, hdr []byte) []byte {
	ad = append(ad, n.Compat[:]...)
	ad = append(ad, n.Scope[:]...)
	ad = append(ad, n.Key[:]...)
	ad = binary.BigEndian.AppendUint32(ad, layer)
	return append(ad, hdr...)
}

// Put stores a verified block, encrypted, atomically.
func (d *Disk) Put(n Name, blk *container.Block) error {
	return d.PutAll([]Item{{n, blk}})[0]
}

// Item is a block to store, for PutAll.
type Item struct {
	Name  Name
	Block *container.Block
}

// PutAll stores blocks as Put does, with one flush for them all (a group
// commit): each is sealed and written to a temporary file, then the
// files are made durable together, then each is renamed into place and
// each directory synced once. errs[i] is item i's. Per file, a flush of
// its own (an ext4 journal commit each) is most of the CPU a block's
// demotion costs.
func (d *Disk) PutAll(items []Item) (errs []error) {
	errs = make([]error, len(items))
	type pending struct {
		i    int
		f    *os.File
		path string
		size int64
	}
	var todo []pending
	defer func() { // whatever was not renamed into place is removed, and its room given back
		for _, p := range todo {
			if p.f != nil {
				p.f.Close()
				os.Remove(p.f.Name())
			}
			if errs[p.i] != nil {
				d.mu.Lock()
				d.used -= p.size
				d.mu.Unlock()
			}
		}
	}()
	for i, it := range items {
		buf, err := d.seal(it.Name, it.Block)
		if err != nil {
			errs[i] = err
			continue
		}
		size := int64(len(*buf))
		d.mu.Lock()
		if d.used+size > d.capacity {
			d.mu.Unlock()
			d.bufs.Put(buf)
			errs[i] = fmt.Errorf("%w: local-storage full", kvsp.ErrUnavailable)
			continue
		}
		d.used += size
		d.mu.Unlock()
		p := pending{i: i, path: d.path(it.Name), size: size}
		err = os.MkdirAll(filepath.Dir(p.path), 0o700)
		if err == nil {
			p.f, err = os.CreateTemp(filepath.Dir(p.path), tmpPrefix+"*")
		}
		if err == nil {
			_, err = p.f.Write(*buf)
		}
		d.bufs.Put(buf)
		if err != nil {
			errs[i] = fmt.Errorf("tier: local-storage: %w", err)
		}
		todo = append(todo, p)
	}
	if len(todo) == 0 {
		return errs
	}
	failpoint.Eval("tier/disk-before-fsync") // RELIABILITY F5: a crash after the write, before fsync
	var files []*os.File
	for _, p := range todo {
		if errs[p.i] == nil {
			files = append(files, p.f)
		}
	}
	if err := syncFiles(files); err != nil {
		for _, p := range todo {
			if errs[p.i] == nil {
				errs[p.i] = fmt.Errorf("tier: local-storage: %w", err)
			}
		}
	}
	failpoint.Eval("tier/disk-before-rename") // RELIABILITY F5: a crash after fsync, before rename
	dirs := map[string]bool{}
	for k, p := range todo {
		if errs[p.i] != nil {
			continue
		}
		err := p.f.Close()
		todo[k].f = nil
		if err == nil {
			err = os.Rename(p.f.Name(), p.path)
		}
		if err != nil {
			os.Remove(p.f.Name())
			errs[p.i] = fmt.Errorf("tier: local-storage: %w", err)
			continue
		}
		dirs[filepath.Dir(p.path)] = true
		n := items[p.i].Name
		d.mu.Lock()
		d.used -= d.size[n] // a rewrite replaces
		d.size[n] = p.size
		d.mu.Unlock()
	}
	for dir := range dirs {
		syncDir(dir)
	}
	return errs
}

// seal encodes blk as its file, in a pooled buffer of exactly its size:
// the magic, the header's length and the header, then each layer's
// nonce and its K and V sealed together (read in place: a layer's K and
// V are contiguous in the block).
func (d *Disk) seal(n Name, blk *container.Block) (*[]byte, error) {
	k, err := d.dataKey(n.Scope, true)
	if err != nil {
		return nil, err
	}
	h := blk.Header()
	hdr := blk.Bytes()[:h.Len()]
	size := len(fileMagic) + 4 + len(hdr)
	for i := range h.Layers {
		size += k.NonceSize() + int(h.Layers[i].K+h.Layers[i].V) + k.Overhead()
	}
	buf := d.bufs.Get(size)
	b := append((*buf)[:0], fileMagic...)
	b = binary.BigEndian.AppendUint32(b, uint32(len(hdr)))
	b = append(b, hdr...)
	ad := make([]byte, 0, 32+16+32+4+len(hdr))
	for i := range h.Layers {
		l := h.FirstLayer + uint32(i)
		v, err := blk.Range(l, l)
		if err != nil {
			d.bufs.Put(buf)
			return nil, err
		}
		nonce := b[len(b) : len(b)+k.NonceSize()]
		if _, err := io.ReadFull(rand.Reader, nonce); err != nil {
			d.bufs.Put(buf)
			return nil, err
		}
		b = k.Seal(b[:len(b)+len(nonce)], nonce, v.Data(), appendLayerAD(ad[:0], n, l, hdr))
	}
	*buf = b
	return buf, nil
}

// Get reads, decrypts and re-verifies a block (container.OpenBlock); any
// tampering is ErrCorrupt.
func (d *Disk) Get(n Name, g container.Geometry) (*container.Block, error) {
	raw, err := os.ReadFile(d.path(n))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: block", kvsp.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if len(raw) < len(fileMagic)+4 || string(raw[:len(fileMagic)]) != fileMagic {
		return nil, ErrCorrupt
	}
	raw = raw[len(fileMagic):]
	hl := int(binary.BigEndian.Uint32(raw))
	raw = raw[4:]
	if hl > len(raw) {
		return nil, ErrCorrupt
	}
	hdr := raw[:hl]
	h, _, err := container.ParseHeader(hdr, g)
	if err != nil {
		return nil, ErrCorrupt
	}
	if h.DataLen() > uint64(len(raw)-hl) { // the sealed sections are longer than the plaintext: a header saying more lies
		return nil, ErrCorrupt
	}
	k, err := d.dataKey(n.Scope, false)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, h.Size())
	out = append(out, hdr...)
	rest := raw[hl:]
	ns := k.NonceSize()
	for i, l := range h.Layers {
		n1 := ns + int(l.K+l.V) + k.Overhead()
		if len(rest) < n1 {
			return nil, ErrCorrupt
		}
		out, err = k.Open(out, rest[:ns], rest[ns:n1], layerAD(n, h.FirstLayer+uint32(i), hdr))
		if err != nil {
			return nil, ErrCorrupt
		}
		rest = rest[n1:]
	}
	if len(rest) != 0 {
		return nil, ErrCorrupt
	}
	blk, err := container.OpenBlock(out, g)
	if err != nil {
		return nil, ErrCorrupt
	}
	return blk, nil
}

// Delete removes a block; a missing one is no error.
func (d *Disk) Delete(n Name) error {
	err := os.Remove(d.path(n))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	d.mu.Lock()
	d.used -= d.size[n]
	delete(d.size, n)
	d.mu.Unlock()
	return nil
}

// List returns the blocks present (after a restart, to serve and publish
// them again).
func (d *Disk) List() []Name {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]Name, 0, len(d.size))
	for n := range d.size {
		out = append(out, n)
	}
	return out
}

// writeAtomic writes a file through a temporary file, fsync and rename,
// then syncs the directory.
func writeAtomic(path string, data []byte) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, tmpPrefix+"*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	failpoint.Eval("tier/disk-before-fsync") // RELIABILITY F5: a crash after the write, before fsync
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	failpoint.Eval("tier/disk-before-rename") // RELIABILITY F5: a crash after fsync, before rename
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	syncDir(dir)
	return nil
}

// syncDir makes a directory's entries durable (best effort: a directory
// that cannot be opened has nothing to sync).
func syncDir(dir string) {
	if dh, err := os.Open(dir); err == nil {
		dh.Sync()
		dh.Close()
	}
}
