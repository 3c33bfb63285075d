package placement

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/kvsp/kvsp"
)

// Store keeps the controller's state across restarts: the highest epoch
// seen per instance and every session with its epoch and latest
// checkpoint, so that no epoch goes backwards when the PC restarts
// (R-ST-6, R-SES-15). Writes happen before the PC answers (a checkpoint's
// acknowledgement releases tokens: it must not be lost).
type Store interface {
	PutInstanceEpoch(instance string, epoch uint64) error
	PutSession(s *Session) error
	Load() (epochs map[string]uint64, sessions []*Session, err error)
	Close() error
}

// BoltStore is the embedded Store: one bbolt file, created 0600 (sessions
// hold output tokens, R-PRV-1).
type BoltStore struct{ db *bolt.DB }

var (
	bucketEpochs   = []byte("instance_epochs")
	bucketSessions = []byte("sessions")
)

// OpenBoltStore opens (or creates) the state file at path.
func OpenBoltStore(path string) (*BoltStore, error) {
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("placement: state %s: %w", path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketEpochs, bucketSessions} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		db.Close()
		return nil, err
	}
	return &BoltStore{db: db}, nil
}

// PutInstanceEpoch implements Store.
func (s *BoltStore) PutInstanceEpoch(instance string, epoch uint64) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketEpochs).Put([]byte(instance), binary.BigEndian.AppendUint64(nil, epoch))
	})
}

// storedSession is a session as stored.
type storedSession struct {
	ID         kvsp.UUID        `json:"session"`
	Epoch      uint64           `json:"epoch"`
	ScopeID    kvsp.ScopeID     `json:"scope_id"`
	CompatID   kvsp.CompatID    `json:"compat_id"`
	Instance   string           `json:"instance"`
	Created    time.Time        `json:"created"`
	MaxTokens  uint64           `json:"max_tokens"`
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
	b, err := kvsp.Marshal(&storedSession{ID: x.ID, Epoch: x.Epoch, ScopeID: x.ScopeID, CompatID: x.CompatID, Instance: x.Instance,
		Created: x.Created, MaxTokens: x.MaxTokens, Checkpoint: x.Checkpoint})
	if err != nil {
		return err
	}
	return s.db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketSessions).Put(x.ID[:], b)
	})
}

// Load implements Store.
func (s *BoltStore) Load() (map[string]uint64, []*Session, error) {
	epochs := map[string]uint64{}
	var sessions []*Session
	err := s.db.View(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketEpochs).ForEach(func(k, v []byte) error {
			if len(v) != 8 {
				return errors.New("placement: state: malformed epoch")
			}
			epochs[string(k)] = binary.BigEndian.Uint64(v)
			return nil
		}); err != nil {
			return err
		}
		return tx.Bucket(bucketSessions).ForEach(func(k, v []byte) error {
			var x storedSession
			if err := kvsp.Decode(v, &x); err != nil {
				return fmt.Errorf("placement: state: session %x: %w", k, err)
			}
			sessions = append(sessions, &Session{ID: x.ID, Epoch: x.Epoch, ScopeID: x.ScopeID, CompatID: x.CompatID, Instance: x.Instance,
				Created: x.Created, MaxTokens: x.MaxTokens, Checkpoint: x.Checkpoint})
			return nil
		})
	})
	return epochs, sessions, err
}

// Close implements Store.
func (s *BoltStore) Close() error { return s.db.Close() }
