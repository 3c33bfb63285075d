package index

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	scopeA  = kvsp.ScopeID{0xa}
	scopeB  = kvsp.ScopeID{0xb}
	compatX = kvsp.CompatID{0x1}
	compatY = kvsp.CompatID{0x2}
)

func key(i int) kvsp.BlockKey {
	var k kvsp.BlockKey
	k[0], k[1], k[31] = byte(i), byte(i>>8), 0x5a
	return k
}

func record(holder string, k kvsp.BlockKey, scope kvsp.ScopeID, compat kvsp.CompatID) *kvsp.ReplicaRecord {
	return &kvsp.ReplicaRecord{BlockKey: k, CompatID: compat, ScopeID: scope, Holder: holder, Codec: 1, Size: 2097152,
		Digest: kvsp.Digest{1}, Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}}, TTLMs: 1000}
}

// backends lists the implementations the conformance suite runs against.
var backends = map[string]func(t *testing.T) Backend{
	"memory": func(t *testing.T) Backend { return NewMemory(100 * time.Millisecond) },
	"redis":  newRedisBackend,
}

func newRedisBackend(t *testing.T) Backend {
	srv := kvsptest.StartRedis(t)
	r, err := NewRedis(context.Background(), RedisConfig{Addrs: []string{srv.Addr}, Password: kvsptest.RedisPassword})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestBackendConformance is the shared suite (STYLE rule 14): inside
// synctest for memory, so TTLs are exact and instant; in real time, with
// a little slack, for Redis, whose TTLs Redis keeps (R-IS-4..6,
// R-IS-13..15, R-IS-20).
func TestBackendConformance(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) { conformance(t, NewMemory(100*time.Millisecond), 0) })
	})
	t.Run("redis", func(t *testing.T) { conformance(t, newRedisBackend(t), 60) })
	t.Run("redis-cluster", func(t *testing.T) {
		addrs := kvsptest.StartRedisCluster(t, 3)
		r, err := NewRedis(context.Background(), RedisConfig{Addrs: addrs, Password: kvsptest.RedisPassword})
		if err != nil {
			t.Fatal(err)
		}
		// Keys hash by block key over all three nodes.
		for i := 0; i < 64; i++ {
			if _, err := r.Put(context.Background(), record("https://h.example/", key(i), scopeB, compatY), time.Minute, PutOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		keys := make([]kvsp.BlockKey, 64)
		for i := range keys {
			keys[i] = key(i)
		}
		if got := lookup(t, r, scopeB, compatY, keys...); len(got) != 64 {
			t.Fatalf("cluster lookup of 64 keys: matched %d", len(got))
		}
		for i := 0; i < 64; i++ {
			if err := r.Delete(context.Background(), "https://h.example/", key(i), nil); err != nil {
				t.Fatal(err)
			}
		}
		conformance(t, r, 60)
	})
}

func lookup(t *testing.T, b Backend, scope kvsp.ScopeID, compat kvsp.CompatID, keys ...kvsp.BlockKey) [][]kvsp.ReplicaRecord {
	t.Helper()
	var res Result
	if err := b.Lookup(context.Background(), scope, compat, keys, &res); err != nil {
		t.Fatal(err)
	}
	return res.Replicas
}

// conformance runs the suite; slackMs is the tolerance on remaining TTLs
// (0: exact).
func conformance(t *testing.T, b Backend, slackMs uint64) {
	near := func(got, want uint64) bool { return got <= want && got+slackMs >= want }
	defer b.Close()
	ctx := context.Background()
	const h1, h2 = "https://h1.example/kvsp/", "https://h2.example/kvsp/"
	put := func(rec *kvsp.ReplicaRecord, ttl time.Duration) bool {
		t.Helper()
		created, err := b.Put(ctx, rec, ttl, PutOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return created
	}
	// Empty: a miss is matched 0.
	if got := lookup(t, b, scopeA, compatX, key(0)); len(got) != 0 {
		t.Fatalf("empty index matched %d", len(got))
	}
	// R-IS-6: create, then idempotent refresh.
	if !put(record(h1, key(0), scopeA, compatX), time.Second) {
		t.Fatal("first put not created")
	}
	if put(record(h1, key(0), scopeA, compatX), time.Second) {
		t.Fatal("refresh reported as created")
	}
	if got := lookup(t, b, scopeA, compatX, key(0)); len(got) != 1 || len(got[0]) != 1 {
		t.Fatalf("one record per holder and key: %v", got)
	}
	// R-IS-14: two holders, both returned.
	put(record(h2, key(0), scopeA, compatX), time.Second)
	if got := lookup(t, b, scopeA, compatX, key(0)); len(got[0]) != 2 {
		t.Fatalf("two holders: %d records", len(got[0]))
	}
	// R-IS-15: the chain stops at the first gap, even when later keys have
	// replicas.
	put(record(h1, key(2), scopeA, compatX), time.Second)
	if got := lookup(t, b, scopeA, compatX, key(0), key(1), key(2)); len(got) != 1 {
		t.Fatalf("K0, K2 published: matched %d, want 1", len(got))
	}
	put(record(h1, key(1), scopeA, compatX), time.Second)
	if got := lookup(t, b, scopeA, compatX, key(0), key(1), key(2), key(3)); len(got) != 3 {
		t.Fatalf("K0..K2 published: matched %d, want 3", len(got))
	}
	// R-IS-20, R-KEY-11: other scope or compat never match.
	if got := lookup(t, b, scopeB, compatX, key(0)); len(got) != 0 {
		t.Fatal("another scope matched")
	}
	if got := lookup(t, b, scopeA, compatY, key(0)); len(got) != 0 {
		t.Fatal("another compat_id matched")
	}
	// R-IS-4: expiry; remaining TTL reported, rounded up.
	time.Sleep(500 * time.Millisecond)
	got := lookup(t, b, scopeA, compatX, key(0))
	if len(got) != 1 || !near(got[0][0].TTLMs, 500) {
		t.Fatalf("at 500 ms: %v", got)
	}
	put(record(h1, key(0), scopeA, compatX), time.Second) // refresh extends from now
	time.Sleep(600 * time.Millisecond)
	got = lookup(t, b, scopeA, compatX, key(0))
	if len(got) != 1 || len(got[0]) != 1 || got[0][0].Holder != h1 || !near(got[0][0].TTLMs, 400) {
		t.Fatalf("at 1100 ms only h1's refreshed record remains: %v", got)
	}
	time.Sleep(time.Duration(400+slackMs) * time.Millisecond)
	if got := lookup(t, b, scopeA, compatX, key(0)); len(got) != 0 {
		t.Fatal("record alive after its TTL")
	}
	// Expired records are swept.
	time.Sleep(time.Second)
	if slackMs == 0 {
		synctest.Wait()
	}
	if n := b.Len(); n != 0 {
		t.Fatalf("%d records left after expiry", n)
	}
	// An expired record re-published is created again.
	if !put(record(h1, key(0), scopeA, compatX), time.Second) {
		t.Fatal("re-publish after expiry not created")
	}
	// Withdraw (R-IS-19): the authorizer sees the record; unknown is 404.
	deny := errors.New("denied")
	if err := b.Delete(ctx, h1, key(0), func(*kvsp.ReplicaRecord) error { return deny }); !errors.Is(err, deny) {
		t.Fatalf("authorizer not consulted: %v", err)
	}
	if err := b.Delete(ctx, h1, key(0), nil); err != nil {
		t.Fatal(err)
	}
	if err := b.Delete(ctx, h1, key(0), nil); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("unknown record: %v", err)
	}
	if got := lookup(t, b, scopeA, compatX, key(0)); len(got) != 0 {
		t.Fatal("withdrawn record still returned")
	}
	// Producer digests (R-SEC-8, S13): a record is accepted only with the
	// digest its producer stated; the first holder to publish a key is
	// not trusted because it was first.
	first := record(h1, key(9), scopeA, compatX)
	pin := PutOptions{PinDigest: true}
	if _, err := b.Put(ctx, first, time.Second, pin); !errors.Is(err, ErrNoProducerDigest) || !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("a record no producer stated a digest for: %v", err)
	}
	stmt := &kvsp.ProducerRecord{BlockKey: key(9), ScopeID: scopeA, CompatID: compatX, Producer: "https://ii1.example/", Digest: first.Digest, TTLMs: 1000}
	if err := b.Pin(ctx, stmt, 500*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	other := record(h2, key(9), scopeA, compatX)
	other.Digest = kvsp.Digest{2}
	if _, err := b.Put(ctx, other, time.Second, pin); !errors.Is(err, ErrDigestConflict) || !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("another digest than the producer's: %v", err)
	}
	if _, err := b.Put(ctx, first, 2*time.Second, pin); err != nil {
		t.Fatalf("the producer's digest: %v", err)
	}
	if _, err := b.Put(ctx, record(h2, key(9), scopeA, compatX), time.Second, pin); err != nil {
		t.Fatalf("the producer's digest from another holder: %v", err)
	}
	bad := *stmt
	bad.Digest = kvsp.Digest{2}
	if err := b.Pin(ctx, &bad, time.Second); !errors.Is(err, ErrProducerConflict) {
		t.Fatalf("a second producer's other digest while the first stands: %v", err)
	}
	if err := b.Pin(ctx, stmt, 500*time.Millisecond); err != nil {
		t.Fatalf("the same statement again: %v", err)
	}
	if _, err := b.Put(ctx, other, time.Second, PutOptions{}); err != nil {
		t.Fatalf("without producer digests: %v", err)
	}
	// The statement lives as long as the records matching it (2 s), and
	// outlives their withdrawal until then; then a new one may be made.
	b.Delete(ctx, h1, key(9), nil)
	b.Delete(ctx, h2, key(9), nil)
	time.Sleep(time.Second)
	if _, err := b.Put(ctx, first, 100*time.Millisecond, pin); err != nil {
		t.Fatalf("the statement expired with its own TTL, before the record's that extended it: %v", err)
	}
	b.Delete(ctx, h1, key(9), nil)
	time.Sleep(1200 * time.Millisecond)
	if err := b.Pin(ctx, &bad, time.Second); err != nil {
		t.Fatalf("a new statement once the first expired: %v", err)
	}
	if _, err := b.Put(ctx, first, time.Second, pin); !errors.Is(err, ErrDigestConflict) {
		t.Fatalf("the old digest against the new statement: %v", err)
	}
	// The per-holder record quota (B9): a holder's new record beyond it
	// is refused, its refreshes are not; another holder is not counted;
	// a withdrawal makes room.
	quota := PutOptions{MaxHolderRecords: 3}
	const hq, hr = "https://quota.example/", "https://other.example/"
	for i := range 3 {
		if _, err := b.Put(ctx, record(hq, key(100+i), scopeA, compatX), time.Minute, quota); err != nil {
			t.Fatalf("record %d within the quota: %v", i, err)
		}
	}
	if _, err := b.Put(ctx, record(hq, key(103), scopeA, compatX), time.Minute, quota); !errors.Is(err, ErrRecordQuota) || !errors.Is(err, kvsp.ErrTooManyRequests) {
		t.Fatalf("a fourth record beyond a quota of 3: %v", err)
	}
	if got := lookup(t, b, scopeA, compatX, key(103)); len(got) != 0 {
		t.Fatal("the refused record was stored")
	}
	if created, err := b.Put(ctx, record(hq, key(101), scopeA, compatX), time.Minute, quota); err != nil || created {
		t.Fatalf("a refresh at the quota: %v %v", created, err)
	}
	if _, err := b.Put(ctx, record(hr, key(103), scopeA, compatX), time.Minute, quota); err != nil {
		t.Fatalf("another holder's record: %v", err)
	}
	if err := b.Delete(ctx, hq, key(100), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Put(ctx, record(hq, key(103), scopeA, compatX), time.Minute, quota); err != nil {
		t.Fatalf("a record after a withdrawal made room: %v", err)
	}
	for _, k := range []int{101, 102, 103} {
		b.Delete(ctx, hq, key(k), nil)
	}
	b.Delete(ctx, hr, key(103), nil)
}

// TestBackendConcurrency: publishes, withdrawals and lookups from many
// goroutines (run under -race by make test).
func TestBackendConcurrency(t *testing.T) {
	for name, newB := range backends {
		t.Run(name, func(t *testing.T) {
			b := newB(t)
			defer b.Close()
			ctx := context.Background()
			var wg sync.WaitGroup
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func(g int) {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(g), 1))
					holder := fmt.Sprintf("https://h%d.example/", g%3)
					for i := 0; i < 2000; i++ {
						k := key(rng.IntN(64))
						switch rng.IntN(3) {
						case 0:
							b.Put(ctx, record(holder, k, scopeA, compatX), time.Duration(1+rng.IntN(5))*time.Millisecond, PutOptions{})
						case 1:
							b.Delete(ctx, holder, k, nil)
						default:
							var res Result
							b.Lookup(ctx, scopeA, compatX, []kvsp.BlockKey{key(0), key(1), key(2)}, &res)
							for _, reps := range res.Replicas {
								if len(reps) == 0 {
									t.Error("empty entry in a lookup")
								}
							}
						}
					}
				}(g)
			}
			wg.Wait()
		})
	}
}

// TestRedisRestart: with Redis killed, operations fail with
// kvsp.ErrUnavailable (a 503 problem); after it restarts empty, they work
// again and holders' republishing restores lookups.
func TestRedisRestart(t *testing.T) {
	srv := kvsptest.StartRedis(t)
	r, err := NewRedis(context.Background(), RedisConfig{Addrs: []string{srv.Addr}, Password: kvsptest.RedisPassword, Timeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	const h = "https://h1.example/kvsp/"
	if _, err := r.Put(ctx, record(h, key(0), scopeA, compatX), time.Minute, PutOptions{}); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	var res Result
	if err := r.Lookup(ctx, scopeA, compatX, []kvsp.BlockKey{key(0)}, &res); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("lookup with Redis down: %v", err)
	}
	if _, err := r.Put(ctx, record(h, key(0), scopeA, compatX), time.Minute, PutOptions{}); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("publish with Redis down: %v", err)
	}
	srv.Restart()
	if err := r.Lookup(ctx, scopeA, compatX, []kvsp.BlockKey{key(0)}, &res); err != nil || len(res.Replicas) != 0 {
		t.Fatalf("after restart (empty): %v %v", res.Replicas, err)
	}
	if created, err := r.Put(ctx, record(h, key(0), scopeA, compatX), time.Minute, PutOptions{}); err != nil || !created {
		t.Fatalf("republish: %v %v", created, err)
	}
	if err := r.Lookup(ctx, scopeA, compatX, []kvsp.BlockKey{key(0)}, &res); err != nil || len(res.Replicas) != 1 {
		t.Fatalf("lookup after republish: %v %v", res.Replicas, err)
	}
}

// TestSnapshotRestart: a restarted memory index answers from its snapshot
// with the remaining TTLs, and drops what expired meanwhile.
func TestSnapshotRestart(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "index.snapshot")
		a := NewMemory(time.Second)
		ctx := context.Background()
		a.Put(ctx, record("https://h1.example/", key(0), scopeA, compatX), 10*time.Second, PutOptions{})
		a.Put(ctx, record("https://h1.example/", key(1), scopeA, compatX), 2*time.Second, PutOptions{})
		if n, err := a.SaveSnapshotFile(path); err != nil || n != 2 {
			t.Fatalf("save: %d %v", n, err)
		}
		a.Close()
		if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("snapshot mode: %v %v", fi, err)
		}
		time.Sleep(3 * time.Second) // the restart takes a while; key(1) expires
		b := NewMemory(time.Second)
		defer b.Close()
		if n, err := b.LoadSnapshotFile(path); err != nil || n != 1 {
			t.Fatalf("load: %d %v", n, err)
		}
		got := lookup(t, b, scopeA, compatX, key(0), key(1))
		if len(got) != 1 || got[0][0].TTLMs != 7000 {
			t.Fatalf("after restart: %+v", got)
		}
		if n, err := b.LoadSnapshotFile(filepath.Join(t.TempDir(), "none")); err != nil || n != 0 {
			t.Fatalf("missing snapshot: %d %v", n, err)
		}
		os.WriteFile(path, []byte("garbage\n"), 0o600)
		if _, err := b.LoadSnapshotFile(path); err == nil {
			t.Fatal("garbage accepted as a snapshot")
		}
	})
}

// TestStoredCodec: the compact form round-trips every member of a record.
func TestStoredCodec(t *testing.T) {
	r := record("https://h1.example/kvsp/", key(3), scopeA, compatX)
	r.LayerDigests = []kvsp.LayerDigest{{1}, {2}}
	r.Residency = append(r.Residency, kvsp.Residency{Tier: kvsp.TierLocalStorage, Layers: kvsp.LayerRange{32, 40}, ReadMbitPerS: 1000})
	r.MOQTNamespace = "AWEBYgFjAWQBZQ"
	b, err := appendStored(nil, r)
	if err != nil {
		t.Fatal(err)
	}
	var a arena
	for _, ar := range []*arena{nil, &a, &a} { // allocated, then arena (cold, warm)
		var got kvsp.ReplicaRecord
		if err := decodeStoredInto(&got, b, ar); err != nil {
			t.Fatal(err)
		}
		got.TTLMs = r.TTLMs
		if !reflect.DeepEqual(&got, r) {
			t.Fatalf("round trip:\n%+v\n%+v", &got, r)
		}
	}
	for i := 0; i < len(b); i++ {
		var x kvsp.ReplicaRecord
		if err := decodeStoredInto(&x, b[:i], &a); err == nil {
			t.Fatalf("prefix %d decoded", i)
		}
	}
}

// TestArenaRecordsIndependent: records decoded into one arena do not share
// memory: each has its own layer digests and residency, full-capacity, so
// an append to one cannot overwrite another.
func TestArenaRecordsIndependent(t *testing.T) {
	var a arena
	var recs [3]kvsp.ReplicaRecord
	for i := range recs {
		r := record("https://h1.example/kvsp/", key(i), scopeA, compatX)
		r.LayerDigests = []kvsp.LayerDigest{{byte(i)}, {byte(i + 10)}}
		b, _ := appendStored(nil, r)
		if err := decodeStoredInto(&recs[i], b, &a); err != nil {
			t.Fatal(err)
		}
	}
	recs[0].LayerDigests = append(recs[0].LayerDigests, kvsp.LayerDigest{99})
	recs[0].Residency = append(recs[0].Residency, kvsp.Residency{Tier: kvsp.TierDevice})
	for i := 1; i < 3; i++ {
		if recs[i].LayerDigests[0][0] != byte(i) || recs[i].LayerDigests[1][0] != byte(i+10) || recs[i].Residency[0].Tier != kvsp.TierHost {
			t.Fatalf("record %d changed by another's append: %+v", i, recs[i])
		}
	}
	if recs[1].Holder != recs[2].Holder || unsafe.StringData(recs[1].Holder) != unsafe.StringData(recs[2].Holder) {
		t.Fatal("holder URIs not interned")
	}
}

// TestEachBulk: the in-place MGET reply parser takes RESP2 and RESP3
// nils, stops where fn says, and refuses error replies and malformed or
// truncated input (a 503 problem, never a panic or a wrong match).
func TestEachBulk(t *testing.T) {
	collect := func(raw string, n int) ([]string, error) {
		var got []string
		err := eachBulk([]byte(raw), n, func(v string) (bool, error) {
			got = append(got, v)
			return v != "stop", nil
		})
		return got, err
	}
	got, err := collect("*4\r\n$3\r\nabc\r\n$-1\r\n_\r\n$0\r\n\r\n", 4)
	if err != nil || !reflect.DeepEqual(got, []string{"abc", "", "", ""}) {
		t.Fatalf("got %q, %v", got, err)
	}
	got, err = collect("*3\r\n$4\r\nstop\r\n$3\r\nabc\r\n", 3) // stops before the truncation
	if err != nil || len(got) != 1 {
		t.Fatalf("got %q, %v", got, err)
	}
	for _, bad := range []string{
		"", "-ERR wrong number of arguments for 'mget' command\r\n", "*2\r\n$3\r\nabc\r\n", "*1\r\n$9\r\nabc\r\n",
		"*1\r\n$x\r\nabc\r\n", "*1\r\n:5\r\n", "*3\r\n", "*1\r\n$-5\r\n", "*1", "$3\r\nabc\r\n",
	} {
		n := 1
		if _, err := collect(bad, n); !errors.Is(err, kvsp.ErrUnavailable) {
			t.Errorf("%q: %v", bad, err)
		}
	}
	if _, err := collect("-ERR secret-key-name here\r\n", 1); err == nil || strings.Contains(err.Error(), "secret") {
		t.Errorf("error reply leaks its text: %v", err)
	}
}
