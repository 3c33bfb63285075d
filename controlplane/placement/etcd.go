package placement

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/kvsp/kvsp"
)

// EtcdConfig configures an EtcdStore.
type EtcdConfig struct {
	Endpoints []string
	// TLS, when set, is used for every connection (client certificates:
	// checkpoints hold output tokens, R-PRV-1).
	TLS *tls.Config
	// Prefix is the key prefix of the PC group; default "/kvsp/pc".
	Prefix string
	// SessionTTL is the leader's lease: a standby takes over this long
	// after the leader stops renewing it; default 3s.
	SessionTTL time.Duration
	// Timeout bounds each request; default 5s.
	Timeout time.Duration
}

// EtcdStore keeps the controller's state in etcd, for a group of PCs of
// which one leads (RunHA): instance epochs, sessions with their
// checkpoints and shard maps under the group's prefix. Writes are fenced:
// each is a transaction that succeeds only while the writer's leadership
// key is the current one, so a deposed leader cannot overwrite its
// successor's state.
type EtcdStore struct {
	cli *clientv3.Client
	cfg EtcdConfig

	mu    sync.Mutex
	fence *fence // nil: not leading, writes refused
}

type fence struct {
	key string
	rev int64
}

// ErrNotLeader: this controller is not its group's leader (a 503 whose
// standby member tells the group's clients to try another).
var ErrNotLeader error = kvsp.NewProblem(kvsp.ErrUnavailable, "this controller is not the leader of its group").With("standby", true)

// OpenEtcdStore connects to etcd.
func OpenEtcdStore(cfg EtcdConfig) (*EtcdStore, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("placement: etcd: no endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/kvsp/pc"
	}
	cfg.Prefix = strings.TrimRight(cfg.Prefix, "/")
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = 3 * time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, TLS: cfg.TLS, DialTimeout: cfg.Timeout, Logger: zap.NewNop()})
	if err != nil {
		return nil, fmt.Errorf("placement: etcd: %w", err)
	}
	return &EtcdStore{cli: cli, cfg: cfg}, nil
}

func (s *EtcdStore) key(kind, id string) string { return s.cfg.Prefix + "/" + kind + "/" + id }

// put writes one key if this store's leadership is current.
func (s *EtcdStore) put(key string, val []byte) error {
	return s.do(clientv3.OpPut(key, string(val)))
}

// DeleteSession implements Store.
func (s *EtcdStore) DeleteSession(scope kvsp.ScopeID, id kvsp.UUID) error {
	return s.do(clientv3.OpDelete(s.key("sessions", scope.String()+"/"+id.String())))
}

// do runs op if this PC still leads (its election key is the one it won).
func (s *EtcdStore) do(op clientv3.Op) error {
	s.mu.Lock()
	f := s.fence
	s.mu.Unlock()
	if f == nil {
		return ErrNotLeader
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	resp, err := s.cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(f.key), "=", f.rev)).
		Then(op).Commit()
	if err != nil {
		return fmt.Errorf("placement: etcd: %w", err)
	}
	if !resp.Succeeded {
		return ErrNotLeader
	}
	return nil
}

// PutInstanceEpoch implements Store.
func (s *EtcdStore) PutInstanceEpoch(instance string, epoch uint64) error {
	return s.put(s.key("epochs", instance), encodeEpoch(epoch))
}

// PutSession implements Store.
func (s *EtcdStore) PutSession(x *Session) error {
	b, err := encodeSession(x)
	if err != nil {
		return err
	}
	return s.put(s.key("sessions", x.ScopeID.String()+"/"+x.ID.String()), b) // ids are unique within a scope only
}

// PutShardMap implements Store.
func (s *EtcdStore) PutShardMap(m *ShardContext) error {
	b, err := encodeShardContext(m)
	if err != nil {
		return err
	}
	return s.put(s.key("maps", m.ScopeID.String()+"/"+m.Map.Map), b)
}

// Load implements Store: the group's state in one read.
func (s *EtcdStore) Load() (*State, error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.cfg.Prefix+"/", clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("placement: etcd: %w", err)
	}
	st := &State{Epochs: map[string]uint64{}}
	for _, kv := range resp.Kvs {
		rest := strings.TrimPrefix(string(kv.Key), s.cfg.Prefix+"/")
		kind, id, _ := strings.Cut(rest, "/")
		switch kind {
		case "epochs":
			e, err := decodeEpoch(kv.Value)
			if err != nil {
				return nil, err
			}
			st.Epochs[id] = e
		case "sessions":
			x, err := decodeSession(kv.Value)
			if err != nil {
				return nil, err
			}
			st.Sessions = append(st.Sessions, x)
		case "maps":
			m, err := decodeShardContext(kv.Value)
			if err != nil {
				return nil, err
			}
			st.Maps = append(st.Maps, m)
		}
	}
	return st, nil
}

// Close implements Store.
func (s *EtcdStore) Close() error { return s.cli.Close() }

func (s *EtcdStore) setFence(f *fence) {
	s.mu.Lock()
	s.fence = f
	s.mu.Unlock()
}

// RunHA makes c a member of its group until ctx ends: it campaigns for
// leadership in etcd (the concurrency package's election, on a lease of
// SessionTTL, with self, the PC's base URI, as the value); when elected it
// loads the group's state from s and serves; when its lease is lost it
// goes back to standby and campaigns again. A standby answers the PC's
// routes with a redirect to the leader (307) or 503. c must have been
// created with Config.Standby and s as its State.
func (c *Controller) RunHA(ctx context.Context, s *EtcdStore, self string) {
	for ctx.Err() == nil {
		if err := c.term(ctx, s, self); err != nil && ctx.Err() == nil {
			c.log.Warn("controller election", "err", err)
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// term runs one session: campaign, lead until the session ends.
func (c *Controller) term(ctx context.Context, s *EtcdStore, self string) error {
	sess, err := concurrency.NewSession(s.cli, concurrency.WithTTL(int(max(1, s.cfg.SessionTTL/time.Second))), concurrency.WithContext(ctx))
	if err != nil {
		return err
	}
	defer sess.Close()
	e := concurrency.NewElection(sess, s.cfg.Prefix+"/leader")
	octx, stopObserving := context.WithCancel(ctx)
	defer stopObserving()
	go func() { // who leads, for the standby's redirects
		for r := range e.Observe(octx) {
			if len(r.Kvs) > 0 {
				v := string(r.Kvs[0].Value)
				c.leader.Store(&v)
			}
		}
	}()
	if err := e.Campaign(ctx, self); err != nil {
		return err
	}
	s.setFence(&fence{key: e.Key(), rev: e.Rev()})
	defer s.setFence(nil)
	st, err := s.Load()
	if err != nil {
		rctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
		e.Resign(rctx)
		cancel()
		return err
	}
	c.load(st)
	c.planTerm.Store(e.Rev()) // etcd revisions only grow: a successor's plans come after ours
	c.leader.Store(&self)
	c.standby.Store(false)
	c.m.leader.Set(1)
	c.log.Info("leading the controller group", "self", self)
	select {
	case <-sess.Done():
		c.log.Warn("controller leadership lost")
	case <-ctx.Done():
	}
	c.standby.Store(true)
	c.m.leader.Set(0)
	rctx, cancel := context.WithTimeout(context.Background(), s.cfg.Timeout)
	defer cancel()
	e.Resign(rctx)
	return nil
}
