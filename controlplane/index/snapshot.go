package index

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/go-json-experiment/json"

	"github.com/kvsp/kvsp"
)

// snapshotMagic is the first line of a snapshot file.
const snapshotMagic = "kvsp-index-snapshot 1"

type snapshotEntry struct {
	ExpiresMs int64              `json:"expires_ms"` // wall clock, ms since the Unix epoch
	Record    kvsp.ReplicaRecord `json:"record"`
}

// WriteSnapshot writes every live record with its expiry time, one JSON
// object per line, so that a restarted IS answers lookups before holders
// have republished. Shards are read one at a time: lookups go on.
func (m *Memory) WriteSnapshot(w io.Writer) (int, error) {
	bw := bufio.NewWriterSize(w, 1<<20)
	if _, err := io.WriteString(bw, snapshotMagic+"\n"); err != nil {
		return 0, err
	}
	now := time.Now()
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.RLock()
		var batch []snapshotEntry
		for _, reps := range s.m {
			for _, r := range reps {
				if r.expires.After(now) {
					batch = append(batch, snapshotEntry{r.expires.UnixMilli(), r.rec})
				}
			}
		}
		s.mu.RUnlock()
		for i := range batch {
			b, err := json.Marshal(&batch[i], json.Deterministic(true))
			if err != nil {
				return n, err
			}
			bw.Write(b)
			if err := bw.WriteByte('\n'); err != nil {
				return n, err
			}
			n++
		}
	}
	return n, bw.Flush()
}

// ReadSnapshot loads records written by WriteSnapshot; records whose
// expiry has passed are skipped, and every record is validated again.
func (m *Memory) ReadSnapshot(r io.Reader) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	if !sc.Scan() || sc.Text() != snapshotMagic {
		return 0, errors.New("index: not a snapshot file")
	}
	now := time.Now()
	n := 0
	for line := 2; sc.Scan(); line++ {
		var e snapshotEntry
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return n, fmt.Errorf("index: snapshot line %d: %v", line, err)
		}
		if err := e.Record.Validate(); err != nil {
			return n, fmt.Errorf("index: snapshot line %d: %w", line, err)
		}
		ttl := time.UnixMilli(e.ExpiresMs).Sub(now)
		if ttl <= 0 {
			continue
		}
		if _, err := m.Put(context.Background(), &e.Record, ttl, PutOptions{}); err != nil {
			return n, err
		}
		n++
	}
	return n, sc.Err()
}

// SaveSnapshotFile writes the snapshot atomically (temporary file, fsync,
// rename), readable by its owner only: records are as confidential as
// prompts (R-PRV-1).
func (m *Memory) SaveSnapshotFile(path string) (int, error) {
	f, err := os.CreateTemp(filepath.Dir(path), ".snapshot-*")
	if err != nil {
		return 0, err
	}
	defer os.Remove(f.Name())
	n, err := m.WriteSnapshot(f)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	return n, err
}

// LoadSnapshotFile loads a snapshot file; a missing file is no error.
func (m *Memory) LoadSnapshotFile(path string) (int, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return m.ReadSnapshot(f)
}
