package index

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-json-experiment/json"
	"github.com/redis/go-redis/v9"

	"github.com/kvsp/kvsp"
)

// RedisConfig configures the Redis (or Valkey) backend.
type RedisConfig struct {
	// Addrs lists one address for a standalone server, or the seed nodes
	// of a Redis Cluster.
	Addrs    []string
	Username string
	Password string
	// TLS, when set, encrypts the connections: replica records are as
	// confidential as prompts (R-PRV-1).
	TLS *tls.Config
	// Prefix namespaces the keys; default "kvsp".
	Prefix string
	// Timeout bounds each operation; default 2s.
	Timeout time.Duration
}

// Redis is the shared backend: several stateless IS processes use one
// Redis or Valkey, standalone or clustered. For a block key K and a holder
// H it keeps
//
//	{prefix}:{K}:H  the record (scope_id, compat_id, JSON), with TTL (PX)
//	{prefix}:{K}:h  the set of H that published K, expiring with the last
//
// under the hash tag {K}, so everything of a key lives in one slot and one
// script handles it; a lookup pipelines one script call per key: one round
// trip per node.
type Redis struct {
	c      redis.UniversalClient
	prefix string
	to     time.Duration
}

var (
	// KEYS[1] record key, KEYS[2] holder set, KEYS[3] pinned digest;
	// ARGV: value, ttl ms, holder id, digest ("" when not pinning).
	putScript = redis.NewScript(`
if ARGV[4] ~= '' then
  local d = redis.call('GET', KEYS[3])
  if d and d ~= ARGV[4] then return -1 end
  if not d then
    redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[2])
  elseif redis.call('PTTL', KEYS[3]) < tonumber(ARGV[2]) then
    redis.call('PEXPIRE', KEYS[3], ARGV[2])
  end
end
local old = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'GET')
redis.call('SADD', KEYS[2], ARGV[3])
local pttl = redis.call('PTTL', KEYS[2])
if pttl < tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
if old then return 0 end
return 1`)
	// KEYS[1] holder set; ARGV[1] the record key prefix ({prefix}:{K}:).
	// Returns value, pttl pairs of the live records, dropping dead members.
	lookupScript = redis.NewScript(`
local out = {}
for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local k = ARGV[1] .. h
  local v = redis.call('GET', k)
  if v then
    out[#out+1] = v
    out[#out+1] = redis.call('PTTL', k)
  else
    redis.call('SREM', KEYS[1], h)
  end
end
return out`)
	// KEYS[1] record key, KEYS[2] holder set, KEYS[3] pinned digest;
	// ARGV[1] holder id. The pin goes with the key's last replica.
	delScript = redis.NewScript(`
local n = redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[3]) end
return n`)
)

// NewRedis connects to Redis and checks the connection.
func NewRedis(ctx context.Context, cfg RedisConfig) (*Redis, error) {
	if len(cfg.Addrs) == 0 {
		return nil, errors.New("index: redis: at least one address")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "kvsp"
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 2 * time.Second
	}
	c := redis.NewUniversalClient(&redis.UniversalOptions{
		Addrs: cfg.Addrs, Username: cfg.Username, Password: cfg.Password, TLSConfig: cfg.TLS,
		ReadTimeout: cfg.Timeout, WriteTimeout: cfg.Timeout, DialTimeout: cfg.Timeout,
		IsClusterMode: len(cfg.Addrs) > 1,
	})
	r := &Redis{c: c, prefix: cfg.Prefix, to: cfg.Timeout}
	pctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := c.Ping(pctx).Err(); err != nil {
		c.Close()
		return nil, fmt.Errorf("index: redis: %w", err)
	}
	return r, nil
}

func (r *Redis) keys(k kvsp.BlockKey, holderID string) (rec, set, recPrefix string) {
	base := r.prefix + ":{" + k.String() + "}:"
	return base + "r:" + holderID, base + "h", base + "r:"
}

// unavailable marks a Redis failure: lookups answer 503 (and recover when
// Redis does).
func unavailable(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: index store: %v", kvsp.ErrUnavailable, err)
}

// encodeStored prefixes the record's JSON with its scope and compat, so a
// lookup filters without decoding other scopes' records.
func encodeStored(rec *kvsp.ReplicaRecord) ([]byte, error) {
	j, err := json.Marshal(rec, json.Deterministic(true))
	if err != nil {
		return nil, err
	}
	b := make([]byte, 0, 48+len(j))
	b = append(b, rec.ScopeID[:]...)
	b = append(b, rec.CompatID[:]...)
	return append(b, j...), nil
}

// Put implements Backend.
func (r *Redis) Put(ctx context.Context, rec *kvsp.ReplicaRecord, ttl time.Duration, pinDigest bool) (bool, error) {
	v, err := encodeStored(rec)
	if err != nil {
		return false, err
	}
	hid := kvsp.ResourceID(rec.Holder)
	rk, sk, _ := r.keys(rec.BlockKey, hid)
	ms := max(ttl.Milliseconds(), 1)
	pin := ""
	if pinDigest {
		// The pin is per key, scope and compat: the digest names all three.
		pin = rec.ScopeID.String() + rec.CompatID.String() + rec.Digest.String()
	}
	dk := strings.TrimSuffix(sk, "h") + "d"
	n, err := putScript.Run(ctx, r.c, []string{rk, sk, dk}, v, ms, hid, pin).Int()
	if err != nil {
		return false, unavailable(err)
	}
	if n < 0 {
		return false, ErrDigestConflict
	}
	return n == 1, nil
}

// Delete implements Backend.
func (r *Redis) Delete(ctx context.Context, holder string, key kvsp.BlockKey, authorize func(*kvsp.ReplicaRecord) error) error {
	hid := kvsp.ResourceID(holder)
	rk, sk, _ := r.keys(key, hid)
	v, err := r.c.Get(ctx, rk).Bytes()
	if errors.Is(err, redis.Nil) {
		return kvsp.ErrNotFound
	}
	if err != nil {
		return unavailable(err)
	}
	if authorize != nil {
		rec, err := decodeStored(v)
		if err != nil {
			return err
		}
		if err := authorize(rec); err != nil {
			return err
		}
	}
	n, err := delScript.Run(ctx, r.c, []string{rk, sk, strings.TrimSuffix(sk, "h") + "d"}, hid).Int()
	if err != nil {
		return unavailable(err)
	}
	if n == 0 {
		return kvsp.ErrNotFound
	}
	return nil
}

func decodeStored(v []byte) (*kvsp.ReplicaRecord, error) {
	if len(v) < 48 {
		return nil, fmt.Errorf("%w: index store holds a malformed record", kvsp.ErrUnavailable)
	}
	var rec kvsp.ReplicaRecord
	if err := json.Unmarshal(v[48:], &rec); err != nil {
		return nil, fmt.Errorf("%w: index store holds a malformed record", kvsp.ErrUnavailable)
	}
	return &rec, nil
}

// Lookup implements Backend: one pipeline of one script call per key.
func (r *Redis) Lookup(ctx context.Context, scope kvsp.ScopeID, compat kvsp.CompatID, keys []kvsp.BlockKey, res *Result) error {
	res.Reset()
	if len(keys) == 0 {
		return nil
	}
	cmds := make([]*redis.Cmd, len(keys))
	_, err := r.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			_, sk, prefix := r.keys(k, "")
			cmds[i] = lookupScript.EvalSha(ctx, p, []string{sk}, prefix)
		}
		return nil
	})
	if err != nil && isNoScript(err) {
		// First use on this server: load the script, then retry once.
		if err := lookupScript.Load(ctx, r.c).Err(); err != nil {
			return unavailable(err)
		}
		return r.Lookup(ctx, scope, compat, keys, res)
	}
	if err != nil {
		return unavailable(err)
	}
	for _, cmd := range cmds {
		vals, err := cmd.Slice()
		if err != nil {
			return unavailable(err)
		}
		start := len(res.flat)
		for j := 0; j+1 < len(vals); j += 2 {
			v, _ := vals[j].(string)
			pttl, _ := vals[j+1].(int64)
			if len(v) < 48 || string(v[:16]) != string(scope[:]) || string(v[16:48]) != string(compat[:]) || pttl <= 0 {
				continue
			}
			rec, err := decodeStored([]byte(v))
			if err != nil {
				return err
			}
			rec.TTLMs = uint64(pttl)
			res.flat = append(res.flat, *rec)
		}
		if len(res.flat) == start {
			break // R-IS-15
		}
		res.add(start)
	}
	return nil
}

func isNoScript(err error) bool { return err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") }

// Len implements Backend: the live records (SCAN; for tests and metrics).
func (r *Redis) Len() int {
	ctx, cancel := context.WithTimeout(context.Background(), r.to)
	defer cancel()
	var n atomic.Int64
	count := func(c *redis.Client) {
		iter := c.Scan(ctx, 0, r.prefix+":{*}:r:*", 1000).Iterator()
		for iter.Next(ctx) {
			n.Add(1)
		}
	}
	switch c := r.c.(type) {
	case *redis.ClusterClient:
		c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { count(m); return nil })
	case *redis.Client:
		count(c)
	}
	return int(n.Load())
}

// Close implements Backend.
func (r *Redis) Close() error { return r.c.Close() }
