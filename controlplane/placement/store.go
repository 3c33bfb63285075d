package placement

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/kvsp/kvsp"
)

// Store keeps the controller's state across restarts: the highest epoch
// seen per instance, every session with its epoch and latest checkpoint,
// and every shard map at its committed version, so that no epoch or
// version goes backwards when the PC restarts (R-ST-6, R-SES-15). Writes
// happen before the PC answers (a checkpoint's acknowledgement releases
// tokens: it must not be lost).
type Store interface {
	PutInstanceEpoch(instance string, epoch uint64) error
	PutSession(s *Session) error
	DeleteSession(scope kvsp.ScopeID, id kvsp.UUID) error
	PutShardMap(m *ShardContext) error
	Load() (*State, error)
	Close() error
}

// State is the controller's stored state.
type State struct {
	Epochs   map[string]uint64
	Sessions []*Session
	Maps     []*ShardContext
}

// BoltStore is the embedded Store: one bbolt file, created 0600 (sessions
// hold output tokens, R-PRV-1).
type BoltStore struct{ db *bolt.DB }

var (
	bucketEpochs   = []byte("instance_epochs")
	bucketSessions = []byte("sessions")
	bucketMaps     = []byte("shard_maps")
)

// OpenBoltStore opens (or creates) the state file at path.
func OpenBoltStore(path string) (*BoltStore, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("placement: state %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketEpochs, bucketSessions, bucketMaps} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return rekeyByScope(tx)
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &BoltStore{db: db}, nil
}

// rekeyByScope moves sessions and maps stored under their id alone (before
// ids were scoped) to their scoped keys, so that deleting them works.
func rekeyByScope(tx *bolt.Tx) error {
	if err := rekey(tx.Bucket(bucketSessions), func(k, v []byte) ([]byte, error) {
		if len(k) != len(kvsp.UUID{}) {
			return k, nil
		}
		x, err := decodeSession(v)
		if err != nil {
			return nil, err
		}
		return sessionDBKey(x.ScopeID, x.ID), nil
	}); err != nil {
		return err
	}
	return rekey(tx.Bucket(bucketMaps), func(_, v []byte) ([]byte, error) {
		x, err := decodeShardContext(v)
		if err != nil {
			return nil, err
		}
		return mapDBKey(x.ScopeID, x.Map.Map), nil
	})
}

// rekey stores each entry of b whose key is not the one keyOf gives under
// that key instead.
func rekey(b *bolt.Bucket, keyOf func(k, v []byte) ([]byte, error)) error {
	type move struct{ from, to, v []byte }
	var moves []move
	if err := b.ForEach(func(k, v []byte) error {
		to, err := keyOf(k, v)
		if err != nil {
			return err
		}
		if !bytes.Equal(k, to) {
			moves = append(moves, move{bytes.Clone(k), to, bytes.Clone(v)})
		}
		return nil
	}); err != nil {
		return err
	}
	for _, m := range moves { // not while iterating
		if err := b.Delete(m.from); err != nil {
			return err
		}
		if err := b.Put(m.to, m.v); err != nil {
			return err
		}
	}
	return nil
}

// PutInstanceEpoch implements Store.
func (s *BoltStore) PutInstanceEpoch(instance string, epoch uint64) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketEpochs).Put([]byte(instance), encodeEpoch(epoch))
	})
}

// storedSession is a session as stored.
type storedSession struct {
	ID         kvsp.UUID        `json:"session"`
	Epoch      uint64           `json:"epoch"`
	ScopeID    kvsp.ScopeID     `json:"scope_id"`
	CompatID   kvsp.CompatID    `json:"compat_id"`
	Instance   string           `json:"instance"`
	InstEpoch  uint64           `json:"instance_epoch,omitzero"`
	Created    time.Time        `json:"created"`
	MaxTokens  uint64           `json:"max_tokens"`
	Prompt     string           `json:"prompt_digest,omitempty"` // hex; absent in state written before it was kept
	Checkpoint *kvsp.Checkpoint `json:"checkpoint,omitempty"`
}

// Validate implements kvsp.Validator.
func (x *storedSession) Validate() error {
	if x.ID.IsZero() || x.Epoch == 0 {
		return fmt.Errorf("%w: session and epoch required", kvsp.ErrInvalid)
	}
	if x.Checkpoint != nil {
		return x.Checkpoint.Validate()
	}
	return nil
}

// PutSession implements Store.
func (s *BoltStore) PutSession(x *Session) error {
	b, err := encodeSession(x)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSessions).Put(sessionDBKey(x.ScopeID, x.ID), b)
	})
}

// sessionDBKey is a session's key in the bucket: scope, then id (ids are
// unique within a scope only).
func sessionDBKey(scope kvsp.ScopeID, id kvsp.UUID) []byte { return append(scope[:], id[:]...) }

// mapDBKey is a shard map's key in the bucket: scope, then the map id.
func mapDBKey(scope kvsp.ScopeID, m string) []byte { return append(scope[:], m...) }

// DeleteSession implements Store.
func (s *BoltStore) DeleteSession(scope kvsp.ScopeID, id kvsp.UUID) error {
	return s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketSessions).Delete(sessionDBKey(scope, id)) })
}

// PutShardMap implements Store.
func (s *BoltStore) PutShardMap(m *ShardContext) error {
	b, err := encodeShardContext(m)
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMaps).Put(mapDBKey(m.ScopeID, m.Map.Map), b)
	})
}

// Load implements Store.
func (s *BoltStore) Load() (*State, error) {
	st := &State{Epochs: map[string]uint64{}}
	err := s.db.View(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketEpochs).ForEach(func(k, v []byte) error {
			e, err := decodeEpoch(v)
			st.Epochs[string(k)] = e
			return err
		}); err != nil {
			return err
		}
		if err := tx.Bucket(bucketMaps).ForEach(func(k, v []byte) error {
			m, err := decodeShardContext(v)
			st.Maps = append(st.Maps, m)
			return err
		}); err != nil {
			return err
		}
		return tx.Bucket(bucketSessions).ForEach(func(k, v []byte) error {
			x, err := decodeSession(v)
			st.Sessions = append(st.Sessions, x)
			return err
		})
	})
	return st, err
}

// The stored forms, shared by the stores.

func encodeEpoch(e uint64) []byte { return binary.BigEndian.AppendUint64(nil, e) }

func decodeEpoch(v []byte) (uint64, error) {
	if len(v) != 8 {
		return 0, errors.New("placement: state: malformed epoch")
	}
	return binary.BigEndian.Uint64(v), nil
}

func encodeSession(x *Session) ([]byte, error) {
	st := &storedSession{ID: x.ID, Epoch: x.Epoch, ScopeID: x.ScopeID, CompatID: x.CompatID, Instance: x.Instance, InstEpoch: x.InstanceEpoch,
		Created: x.Created, MaxTokens: x.MaxTokens, Checkpoint: x.Checkpoint}
	if x.Prompt != [32]byte{} {
		st.Prompt = hex.EncodeToString(x.Prompt[:])
	}
	return kvsp.Marshal(st)
}

func decodeSession(v []byte) (*Session, error) {
	var x storedSession
	if err := kvsp.Decode(v, &x); err != nil {
		return nil, fmt.Errorf("placement: state: session: %w", err)
	}
	s := &Session{ID: x.ID, Epoch: x.Epoch, ScopeID: x.ScopeID, CompatID: x.CompatID, Instance: x.Instance, InstanceEpoch: x.InstEpoch,
		Created: x.Created, MaxTokens: x.MaxTokens, Checkpoint: x.Checkpoint}
	if x.Prompt != "" {
		if b, err := hex.DecodeString(x.Prompt); err != nil || len(b) != len(s.Prompt) {
			return nil, errors.New("placement: state: session: malformed prompt_digest")
		} else {
			copy(s.Prompt[:], b)
		}
	}
	return s, nil
}

// storedMap is a shard map as stored.
type storedMap struct {
	Map      kvsp.ShardMap   `json:"map"`
	ScopeID  kvsp.ScopeID    `json:"scope_id"`
	CompatID kvsp.CompatID   `json:"compat_id"`
	Keys     []kvsp.BlockKey `json:"block_keys"`
}

// Validate implements kvsp.Validator.
func (m *storedMap) Validate() error { return m.Map.Validate() }

func encodeShardContext(m *ShardContext) ([]byte, error) {
	return kvsp.Marshal(&storedMap{Map: m.Map, ScopeID: m.ScopeID, CompatID: m.CompatID, Keys: m.Keys})
}

func decodeShardContext(v []byte) (*ShardContext, error) {
	var x storedMap
	if err := kvsp.Decode(v, &x); err != nil {
		return nil, fmt.Errorf("placement: state: shard map: %w", err)
	}
	return &ShardContext{Map: x.Map, ScopeID: x.ScopeID, CompatID: x.CompatID, Keys: x.Keys}, nil
}

// Close implements Store.
func (s *BoltStore) Close() error { return s.db.Close() }
