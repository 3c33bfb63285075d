package index_test

import (
	"bytes"
	"context"
	stdjson "encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// plainRecord is what the plain handler stores: the record with string
// members, as a straightforward encoding/json service would.
type plainRecord struct {
	BlockKey     string   `json:"block_key"`
	CompatID     string   `json:"compat_id"`
	ScopeID      string   `json:"scope_id"`
	Holder       string   `json:"holder"`
	Codec        int      `json:"codec"`
	Size         int64    `json:"size"`
	Digest       string   `json:"digest"`
	LayerDigests []string `json:"layer_digests,omitempty"`
	Residency    []struct {
		Tier   string `json:"tier"`
		Layers [2]int `json:"layers"`
	} `json:"residency"`
	TTLMs int64 `json:"ttl_ms"`
}

// lookupFixture is the data both servers serve: 200 chains of 64 keys,
// one replica per key.
type lookupFixture struct {
	svc    *index.Service
	plain  map[string]plainRecord
	bodies [][]byte // one lookup request per chain
}

func newLookupFixture(tb testing.TB, layerDigests int) *lookupFixture {
	scope, _ := kvsp.ParseScopeID(kvsptest.Scope)
	mem := index.NewMemory(time.Minute)
	tb.Cleanup(func() { mem.Close() })
	svc, err := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096}, mem)
	if err != nil {
		tb.Fatal(err)
	}
	f := &lookupFixture{svc: svc, plain: map[string]plainRecord{}}
	const chains, perChain = 200, 64
	for c := 0; c < chains; c++ {
		var keys []kvsp.BlockKey
		for i := 0; i < perChain; i++ {
			r := &kvsp.ReplicaRecord{BlockKey: kvsp.BlockKey{byte(c), byte(c >> 8), byte(i), 7}, CompatID: kvsp.CompatID{1}, ScopeID: scope,
				Holder: fmt.Sprintf("https://holder%02d.example/kvsp/", c%16), Codec: 1, Size: 2097152, Digest: kvsp.Digest{byte(i)},
				LayerDigests: make([]kvsp.LayerDigest, layerDigests), TTLMs: 600000,
				Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}}}
			mem.Put(context.Background(), r, time.Hour, index.PutOptions{})
			keys = append(keys, r.BlockKey)
			pr := plainRecord{BlockKey: r.BlockKey.String(), CompatID: r.CompatID.String(), ScopeID: r.ScopeID.String(), Holder: r.Holder,
				Codec: 1, Size: 2097152, Digest: r.Digest.String(), TTLMs: 600000}
			for range layerDigests {
				pr.LayerDigests = append(pr.LayerDigests, strings.Repeat("0", 64))
			}
			pr.Residency = append(pr.Residency, struct {
				Tier   string `json:"tier"`
				Layers [2]int `json:"layers"`
			}{"host", [2]int{0, 31}})
			f.plain[pr.BlockKey] = pr
		}
		q := kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys}
		body, _ := kvsp.Marshal(&q)
		f.bodies = append(f.bodies, body)
	}
	return f
}

// plainHandler is the comparison: encoding/json in, encoding/json out.
func (f *lookupFixture) plainHandler() http.Handler {
	type plainReq struct {
		ScopeID   string   `json:"scope_id"`
		CompatID  string   `json:"compat_id"`
		BlockKeys []string `json:"block_keys"`
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var q plainReq
		if err := stdjson.NewDecoder(r.Body).Decode(&q); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		resp := struct {
			Matched  int             `json:"matched"`
			Replicas [][]plainRecord `json:"replicas"`
		}{}
		for _, k := range q.BlockKeys {
			rec, ok := f.plain[k]
			if !ok {
				break
			}
			resp.Replicas = append(resp.Replicas, []plainRecord{rec})
		}
		resp.Matched = len(resp.Replicas)
		w.Header().Set("Content-Type", "application/json")
		stdjson.NewEncoder(w).Encode(&resp)
	})
}

// startLookupServers starts the IS and the plain handler behind the same
// mutual TLS configuration; it returns their lookup URLs.
func (f *lookupFixture) startLookupServers(tb testing.TB, p *kvsptest.PKI) (kvspURL, plainURL string) {
	s := kvsptest.StartServer(tb, p, kvsptest.Options{}, func(srv *server.Server) {
		if err := f.svc.Mount(srv.Mount("/is/")); err != nil {
			tb.Fatal(err)
		}
	})
	plainSrv := &http.Server{Handler: f.plainHandler(), TLSConfig: s.TLSConfig().Clone()}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	go plainSrv.ServeTLS(ln, "", "")
	tb.Cleanup(func() { plainSrv.Close() })
	return s.URL("/is/lookup"), "https://" + ln.Addr().String() + "/lookup"
}

// lookupLoad sends n lookups (all of them when n is 0: until pb ends) from
// parallel goroutines and checks each answer.
func lookupLoad(b *testing.B, client *http.Client, url string, bodies [][]byte) int64 {
	var n atomic.Int64
	b.SetParallelism(2)
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			req, _ := http.NewRequest("POST", url, bytes.NewReader(bodies[i%len(bodies)]))
			req.Header.Set("Content-Type", kvsp.MediaType)
			resp, err := client.Do(req)
			if err != nil {
				b.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
			i++
			n.Add(1)
		}
	})
	return n.Load()
}

// TestLookupServerProcess is not a test: BenchmarkLookupServerCPU runs the
// test binary with it selected to serve lookups from a process of its own,
// whose CPU time is then the server's alone (the comparison is per
// server core: the plain handler's 8.5k lookups/s per core).
func TestLookupServerProcess(t *testing.T) {
	kind := os.Getenv("KVSP_LOOKUP_SERVER")
	if kind == "" {
		t.Skip("the server process of BenchmarkLookupServerCPU")
	}
	ld, _ := strconv.Atoi(os.Getenv("KVSP_LOOKUP_DIGESTS"))
	p := kvsptest.NewPKI(t)
	f := newLookupFixture(t, ld)
	kvspURL, plainURL := f.startLookupServers(t, p)
	p.WriteLeaf("client.pem", "client.key", p.Leaf(kvsptest.ClientA))
	url := kvspURL
	if kind == "plain" {
		url = plainURL
	}
	if prof := os.Getenv("KVSP_LOOKUP_CPUPROFILE"); prof != "" { // a profile of the server alone, per kind
		os.Setenv("KVSP_LOOKUP_CPUPROFILE_FILE", prof+"."+kind)
	}
	kvsptest.ServeFromProcess(t, url, p, "KVSP_LOOKUP_CPUPROFILE_FILE")
}

// BenchmarkLookupServerCPU: the server CPU time per lookup of the IS and
// of a plain encoding/json handler serving the same records, each in its
// own process (so the load generator's CPU is not counted), over the same
// mutual TLS, under the same load from this process (4 clients, 64-key
// lookups, all matching), over HTTP/2 and HTTP/1.1, with and without 32
// layer digests per record. The target: at least 2x the plain
// handler's lookups/s per core.
func BenchmarkLookupServerCPU(b *testing.B) {
	for _, proto := range []string{"h2", "http/1.1"} {
		for _, ld := range []int{32, 0} {
			b.Run(fmt.Sprintf("%s/layer_digests=%d", strings.ReplaceAll(proto, "/", ""), ld), func(b *testing.B) {
				for _, kind := range []string{"kvsp", "plain"} {
					b.Run(kind, func(b *testing.B) { benchServerProcess(b, kind, ld, proto) })
				}
			})
		}
	}
}

func benchServerProcess(b *testing.B, kind string, layerDigests int, proto string) float64 {
	srv := kvsptest.StartProcess(b, "TestLookupServerProcess", "KVSP_LOOKUP_SERVER="+kind, "KVSP_LOOKUP_DIGESTS="+strconv.Itoa(layerDigests), "GOMAXPROCS=2")
	defer srv.Close() // one process per round of the benchmark
	url, tc := srv.URL, srv.ClientTLS(b, proto)
	client := kvsptest.HTTPClient(b, &http.Transport{TLSClientConfig: tc, MaxIdleConnsPerHost: 8})
	f := newLookupFixture(b, 0) // the request bodies (the same keys)
	meter := kvsptest.NewCPUMeter(srv.Pid)
	b.ResetTimer()
	meter.Start()
	n := lookupLoad(b, client, url, f.bodies)
	meter.Stop()
	b.StopTimer() // the server process's shutdown is not the lookups'
	client.CloseIdleConnections()
	us := float64(meter.Peers.Microseconds()) / float64(n)
	b.ReportMetric(us, "server-cpu-us/lookup")
	b.ReportMetric(1e6/us, "lookups/s/core")
	return us
}
