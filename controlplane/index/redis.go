package index

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

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
// Redis or Valkey, standalone or clustered. A block key K is one string
//
//	{prefix}:{K}:r  entries "<expiry ms>,<holder-id>,<length>:<compact record>", one per holder
//	{prefix}:{K}:d  the digest its producer stated (Pin), for producer digests
//
// under the hash tag {K}. Expiry times come from the Redis server's clock
// (TIME); a write rewrites the string without its expired entries and with
// PX set to its longest-lived entry, so Redis drops keys whose replicas
// all expired. A lookup is one MGET of all its keys and a TIME on a
// standalone server (one command, one round trip), and pipelined GETs on a
// cluster (one round trip per node).
type Redis struct {
	c      redis.UniversalClient
	prefix string
	to     time.Duration
}

// luaNow is the Redis server's time in ms.
const luaNow = `local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
`

// luaEntries parses a key's value into live entries {exp, hid, text}.
const luaEntries = `
local function entries(v, now)
  local out = {}
  if not v then return out end
  local pos = 1
  while pos <= #v do
    local c1 = string.find(v, ',', pos, true)
    local c2 = string.find(v, ',', c1 + 1, true)
    local c3 = string.find(v, ':', c2 + 1, true)
    local exp = tonumber(string.sub(v, pos, c1 - 1))
    local hid = string.sub(v, c1 + 1, c2 - 1)
    local len = tonumber(string.sub(v, c2 + 1, c3 - 1))
    local stop = c3 + len
    if exp > now then out[#out+1] = {exp, hid, string.sub(v, pos, stop)} end
    pos = stop + 1
  end
  return out
end
local function store(key, list, now)
  if #list == 0 then redis.call('DEL', key) return end
  local parts, maxexp = {}, 0
  for i, e in ipairs(list) do
    parts[i] = e[3]
    if e[1] > maxexp then maxexp = e[1] end
  end
  redis.call('SET', key, table.concat(parts), 'PX', maxexp - now)
end
`

var (
	// KEYS[1] record key, KEYS[2] the producer's digest; ARGV: holder id,
	// record, ttl ms, its digest ("" when not pinning). Returns 1
	// created, 0 refreshed, -1 digest conflict, -2 no producer's digest.
	putScript = redis.NewScript(luaNow + luaEntries + `
local ttl = tonumber(ARGV[3])
if ARGV[4] ~= '' then
  local d = redis.call('GET', KEYS[2])
  if not d then return -2 end
  if d ~= ARGV[4] then return -1 end
  if redis.call('PTTL', KEYS[2]) < ttl then
    redis.call('PEXPIRE', KEYS[2], ttl)
  end
end
local list, created = {}, 1
for _, e in ipairs(entries(redis.call('GET', KEYS[1]), now)) do
  if e[2] == ARGV[1] then created = 0 else list[#list+1] = e end
end
local exp = now + ttl
list[#list+1] = {exp, ARGV[1], tostring(exp) .. ',' .. ARGV[1] .. ',' .. tostring(#ARGV[2]) .. ':' .. ARGV[2]}
store(KEYS[1], list, now)
return created`)
	// KEYS[1] record key; ARGV[1] holder id. Returns the live entry or nil.
	getScript = redis.NewScript(luaNow + luaEntries + `
for _, e in ipairs(entries(redis.call('GET', KEYS[1]), now)) do
  if e[2] == ARGV[1] then return e[3] end
end
return false`)
	// KEYS[1] record key; ARGV[1] holder id. The producer's digest stays
	// until it expires. Returns 1 deleted, 0 not found.
	delScript = redis.NewScript(luaNow + luaEntries + `
local list, found = {}, 0
for _, e in ipairs(entries(redis.call('GET', KEYS[1]), now)) do
  if e[2] == ARGV[1] then found = 1 else list[#list+1] = e end
end
store(KEYS[1], list, now)
return found`)
	// KEYS[1] the producer's digest; ARGV: the statement, ttl ms. A
	// longer-lived one stands. Returns 1 stored, -1 another statement.
	pinScript = redis.NewScript(`
local ttl = tonumber(ARGV[2])
local d = redis.call('GET', KEYS[1])
if d and d ~= ARGV[1] then return -1 end
if not d or redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
end
return 1`)
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

func (r *Redis) keys(k kvsp.BlockKey) (records, pin string) {
	base := r.prefix + ":{" + k.String() + "}:"
	return base + "r", base + "d"
}

// keyNames returns the record key names of keys ("{prefix}:{K}:r"), built
// in res's reused buffer: the strings alias it and are valid until the
// next call.
func (res *Result) keyNames(prefix string, keys []kvsp.BlockKey) []string {
	n := len(prefix) + 2 + 2*len(kvsp.BlockKey{}) + 3
	res.names = slices.Grow(res.names[:0], n*len(keys))
	out := make([]string, len(keys))
	for i, k := range keys {
		start := len(res.names)
		res.names = append(res.names, prefix...)
		res.names = append(res.names, ":{"...)
		res.names = hex.AppendEncode(res.names, k[:])
		res.names = append(res.names, "}:r"...)
		out[i] = unsafe.String(&res.names[start], n)
	}
	return out
}

// unavailable marks a Redis failure: lookups answer 503 (and recover when
// Redis does).
func unavailable(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: index store: %v", kvsp.ErrUnavailable, err)
}

// Put implements Backend.
func (r *Redis) Put(ctx context.Context, rec *kvsp.ReplicaRecord, ttl time.Duration, o PutOptions) (bool, error) {
	v, err := appendStored(nil, rec)
	if err != nil {
		return false, err
	}
	hash, pinKey := r.keys(rec.BlockKey)
	hid := kvsp.ResourceID(rec.Holder)
	if o.MaxHolderRecords > 0 {
		if err := r.holderQuota(ctx, hid, rec.BlockKey, o.MaxHolderRecords); err != nil {
			return false, err
		}
	}
	pin := ""
	if o.PinDigest {
		pin = rec.ScopeID.String() + rec.CompatID.String() + rec.Digest.String() // per key, scope and compat
	}
	n, err := putScript.Run(ctx, r.c, []string{hash, pinKey}, hid, v, max(ttl.Milliseconds(), 1), pin).Int()
	switch {
	case err != nil:
		return false, unavailable(err)
	case n == -2:
		return false, ErrNoProducerDigest
	case n < 0:
		return false, ErrDigestConflict
	}
	if o.MaxHolderRecords > 0 {
		set := r.holderSet(hid)
		exp := time.Now().Add(ttl).UnixMilli()
		p := r.c.Pipeline()
		p.ZAdd(ctx, set, redis.Z{Score: float64(exp), Member: rec.BlockKey.String()})
		p.PExpire(ctx, set, r.holderSetTTL(ttl))
		if _, err := p.Exec(ctx); err != nil {
			return false, unavailable(err)
		}
	}
	return n == 1, nil
}

// Pin implements Backend.
func (r *Redis) Pin(ctx context.Context, rec *kvsp.ProducerRecord, ttl time.Duration) error {
	_, pinKey := r.keys(rec.BlockKey)
	stmt := rec.ScopeID.String() + rec.CompatID.String() + rec.Digest.String() // as Put compares it
	n, err := pinScript.Run(ctx, r.c, []string{pinKey}, stmt, max(ttl.Milliseconds(), 1)).Int()
	switch {
	case err != nil:
		return unavailable(err)
	case n < 0:
		return ErrProducerConflict
	}
	return nil
}

// holderSet is the key of a holder's record set (the per-holder quota):
// members are its block keys, scores their expiry in ms. It is kept beside
// the records, not with them (another hash slot), so the quota is checked
// before the record's script, not atomically with it: concurrent publishes
// of one holder can pass it by the few under way.
func (r *Redis) holderSet(hid string) string { return r.prefix + ":h:{" + hid + "}" }

// holderSetTTL outlives the set's longest record, so an idle holder's set
// goes away.
func (r *Redis) holderSetTTL(ttl time.Duration) time.Duration {
	return max(ttl, time.Minute) + time.Minute
}

// holderQuota refuses a new record of a holder with max live ones.
func (r *Redis) holderQuota(ctx context.Context, hid string, key kvsp.BlockKey, limit int) error {
	set := r.holderSet(hid)
	p := r.c.Pipeline()
	p.ZRemRangeByScore(ctx, set, "-inf", strconv.FormatInt(time.Now().UnixMilli(), 10))
	card := p.ZCard(ctx, set)
	score := p.ZScore(ctx, set, key.String())
	if _, err := p.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return unavailable(err)
	}
	if card.Val() >= int64(limit) && errors.Is(score.Err(), redis.Nil) {
		return ErrRecordQuota
	}
	return nil
}

// Delete implements Backend.
func (r *Redis) Delete(ctx context.Context, holder string, key kvsp.BlockKey, authorize func(*kvsp.ReplicaRecord) error) error {
	hid := kvsp.ResourceID(holder)
	hash, _ := r.keys(key)
	v, err := getScript.Run(ctx, r.c, []string{hash}, hid).Text()
	if errors.Is(err, redis.Nil) {
		return kvsp.ErrNotFound
	}
	if err != nil {
		return unavailable(err)
	}
	if authorize != nil {
		var rec kvsp.ReplicaRecord
		err := parseEntries(v, func(_ int64, _, text string) error {
			if err := decodeStoredInto(&rec, []byte(text), nil); err != nil {
				return unavailable(err)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if err := authorize(&rec); err != nil {
			return err
		}
	}
	n, err := delScript.Run(ctx, r.c, []string{hash}, hid).Int()
	if err != nil {
		return unavailable(err)
	}
	if err := r.c.ZRem(ctx, r.holderSet(hid), key.String()).Err(); err != nil { // the per-holder quota's count
		return unavailable(err)
	}
	if n == 0 {
		return kvsp.ErrNotFound
	}
	return nil
}

// parseEntries calls fn for each entry of a key's value: expiry ms,
// holder id, compact record.
func parseEntries(v string, fn func(exp int64, hid, rec string) error) error {
	for len(v) > 0 {
		c1 := strings.IndexByte(v, ',')
		if c1 < 0 {
			return unavailable(errStored)
		}
		c2 := strings.IndexByte(v[c1+1:], ',') + c1 + 1
		if c2 <= c1 {
			return unavailable(errStored)
		}
		c3 := strings.IndexByte(v[c2+1:], ':') + c2 + 1
		if c3 <= c2 {
			return unavailable(errStored)
		}
		exp, err1 := strconv.ParseInt(v[:c1], 10, 64)
		n, err2 := strconv.Atoi(v[c2+1 : c3])
		if err1 != nil || err2 != nil || n < 0 || c3+1+n > len(v) {
			return unavailable(errStored)
		}
		if err := fn(exp, v[c1+1:c2], v[c3+1:c3+1+n]); err != nil {
			return err
		}
		v = v[c3+1+n:]
	}
	return nil
}

func filterArg(scope kvsp.ScopeID, compat kvsp.CompatID) string {
	b := make([]byte, 0, storedFilterLen)
	b = append(b, storedVersion)
	b = append(b, scope[:]...)
	return string(append(b, compat[:]...))
}

// Lookup implements Backend.
func (r *Redis) Lookup(ctx context.Context, scope kvsp.ScopeID, compat kvsp.CompatID, keys []kvsp.BlockKey, res *Result) error {
	res.Reset()
	if len(keys) == 0 {
		return nil
	}
	names := res.keyNames(r.prefix, keys)
	var (
		tm    *redis.TimeCmd
		mget  *redis.RawWriteToCmd
		gets  []*redis.StringCmd
		_, cl = r.c.(*redis.ClusterClient)
	)
	_, err := r.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		tm = p.Time(ctx)
		if !cl {
			// One MGET whose reply is copied raw into the Result's
			// buffer and parsed in place: no allocation per value.
			res.args = append(res.args[:0], "mget")
			for _, n := range names {
				res.args = append(res.args, n)
			}
			res.reply.Reset()
			mget = redis.NewRawWriteToCmd(ctx, &res.reply, res.args...)
			return p.Process(ctx, mget)
		}
		// A cluster pipeline runs per node concurrently: one GET per key.
		gets = make([]*redis.StringCmd, len(names))
		for i, n := range names {
			gets[i] = p.Get(ctx, n)
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return unavailable(err)
	}
	now := tm.Val().UnixMilli()
	filter := filterArg(scope, compat)
	match := func(v string) (bool, error) {
		start := len(res.flat)
		err := parseEntries(v, func(exp int64, _ string, rec string) error {
			if exp <= now || len(rec) < storedFilterLen || rec[:storedFilterLen] != filter {
				return nil
			}
			res.flat = append(res.flat, kvsp.ReplicaRecord{})
			out := &res.flat[len(res.flat)-1]
			if err := decodeStoredInto(out, unsafe.Slice(unsafe.StringData(rec), len(rec)), &res.arena); err != nil {
				return unavailable(err)
			}
			out.TTLMs = uint64(exp - now)
			return nil
		})
		if err != nil || len(res.flat) == start {
			return false, err // R-IS-15: stop at the first key with none
		}
		res.add(start)
		return true, nil
	}
	if mget != nil {
		return eachBulk(res.reply.Bytes(), len(names), match)
	}
	for _, g := range gets {
		if ok, err := match(g.Val()); !ok || err != nil {
			return err
		}
	}
	return nil
}

// eachBulk walks a raw RESP array reply of n bulk strings (nil for a
// missing key, in RESP2 or RESP3 form), calling fn with each value (which
// aliases b) until fn returns false or an error.
func eachBulk(b []byte, n int, fn func(v string) (bool, error)) error {
	line := func() (string, bool) {
		i := bytes.Index(b, []byte("\r\n"))
		if i < 1 {
			return "", false
		}
		l := unsafe.String(&b[0], i)
		b = b[i+2:]
		return l, true
	}
	h, ok := line()
	if !ok || h[0] != '*' {
		return unavailable(fmt.Errorf("index: redis: MGET answered %q", redisErrorLine(h)))
	}
	if c, err := strconv.Atoi(h[1:]); err != nil || c != n {
		return unavailable(errors.New("index: redis: malformed MGET reply"))
	}
	for range n {
		h, ok := line()
		if !ok {
			return unavailable(errors.New("index: redis: malformed MGET reply"))
		}
		var v string
		switch {
		case h == "$-1" || h == "_":
		case h[0] == '$':
			l, err := strconv.Atoi(h[1:])
			if err != nil || l < 0 || len(b) < l+2 {
				return unavailable(errors.New("index: redis: malformed MGET reply"))
			}
			if l > 0 {
				v = unsafe.String(&b[0], l)
			}
			b = b[l+2:]
		default:
			return unavailable(errors.New("index: redis: malformed MGET reply"))
		}
		if ok, err := fn(v); !ok || err != nil {
			return err
		}
	}
	return nil
}

// redisErrorLine keeps an error reply's first word (its code), never the
// rest, which might quote keys.
func redisErrorLine(h string) string {
	if len(h) > 0 && h[0] == '-' {
		if i := strings.IndexByte(h, ' '); i > 0 {
			return h[:i]
		}
	}
	if len(h) > 16 {
		return h[:16]
	}
	return h
}

// Len implements Backend: the live records (SCAN; for tests and metrics).
func (r *Redis) Len() int {
	ctx, cancel := context.WithTimeout(context.Background(), r.to)
	defer cancel()
	var n atomic.Int64
	count := func(c *redis.Client) {
		iter := c.Scan(ctx, 0, r.prefix+":{*}:r", 1000).Iterator()
		for iter.Next(ctx) {
			v, _ := c.Get(ctx, iter.Val()).Result()
			parseEntries(v, func(int64, string, string) error { n.Add(1); return nil })
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
