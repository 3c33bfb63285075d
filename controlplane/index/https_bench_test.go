package index_test

import (
	"bytes"
	"context"
	stdjson "encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
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

// BenchmarkLookupHTTPS compares, in the same run and over the same mutual
// TLS loopback, the IS's lookup with a plain encoding/json handler serving
// the same records (the target: at least 2x the plain handler).
// 64-key lookups, all matching, one replica per key with 32 layer digests;
// 4 concurrent HTTP/2 clients.
func BenchmarkLookupHTTPS(b *testing.B) {
	for _, ld := range []int{32, 0} {
		b.Run(fmt.Sprintf("layer_digests=%d", ld), func(b *testing.B) { benchLookupHTTPS(b, ld) })
	}
}

func benchLookupHTTPS(b *testing.B, layerDigests int) {
	p := kvsptest.NewPKI(b)
	scope, _ := kvsp.ParseScopeID(kvsptest.Scope)
	mem := index.NewMemory(time.Minute)
	defer mem.Close()
	svc, err := index.New(index.Config{MaxTTL: time.Hour, MaxLookupKeys: 4096}, mem)
	if err != nil {
		b.Fatal(err)
	}
	plain := map[string]plainRecord{}
	const chains, perChain = 200, 64
	keys := make([][]kvsp.BlockKey, chains)
	for c := 0; c < chains; c++ {
		for i := 0; i < perChain; i++ {
			r := &kvsp.ReplicaRecord{BlockKey: kvsp.BlockKey{byte(c), byte(c >> 8), byte(i), 7}, CompatID: kvsp.CompatID{1}, ScopeID: scope,
				Holder: fmt.Sprintf("https://holder%02d.example/kvsp/", c%16), Codec: 1, Size: 2097152, Digest: kvsp.Digest{byte(i)},
				LayerDigests: make([]kvsp.LayerDigest, layerDigests), TTLMs: 600000,
				Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}}}
			mem.Put(context.Background(), r, time.Hour, false)
			keys[c] = append(keys[c], r.BlockKey)
			pr := plainRecord{BlockKey: r.BlockKey.String(), CompatID: r.CompatID.String(), ScopeID: r.ScopeID.String(), Holder: r.Holder,
				Codec: 1, Size: 2097152, Digest: r.Digest.String(), TTLMs: 600000}
			for range layerDigests {
				pr.LayerDigests = append(pr.LayerDigests, strings.Repeat("0", 64))
			}
			pr.Residency = append(pr.Residency, struct {
				Tier   string `json:"tier"`
				Layers [2]int `json:"layers"`
			}{"host", [2]int{0, 31}})
			plain[pr.BlockKey] = pr
		}
	}
	s := kvsptest.StartServer(b, p, kvsptest.Options{}, func(srv *server.Server) {
		if err := svc.Mount(srv.Mount("/is/")); err != nil {
			b.Fatal(err)
		}
	})
	// The plain handler: encoding/json in, encoding/json out, same TLS.
	type plainReq struct {
		ScopeID   string   `json:"scope_id"`
		CompatID  string   `json:"compat_id"`
		BlockKeys []string `json:"block_keys"`
	}
	plainSrv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
			rec, ok := plain[k]
			if !ok {
				break
			}
			resp.Replicas = append(resp.Replicas, []plainRecord{rec})
		}
		resp.Matched = len(resp.Replicas)
		w.Header().Set("Content-Type", "application/json")
		stdjson.NewEncoder(w).Encode(&resp)
	}), TLSConfig: s.TLSConfig().Clone()}
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go plainSrv.ServeTLS(ln, "", "")
	defer plainSrv.Close()

	bodies := make([][]byte, chains)
	for c := range bodies {
		q := kvsp.LookupRequest{ScopeID: scope, CompatID: kvsp.CompatID{1}, BlockKeys: keys[c]}
		bodies[c], _ = kvsp.Marshal(&q)
	}
	client := kvsptest.HTTPClient(b, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(kvsptest.ClientA)), MaxIdleConnsPerHost: 8})
	run := func(b *testing.B, url string) {
		var n atomic.Int64
		b.SetParallelism(2)
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				req, _ := http.NewRequest("POST", url, bytes.NewReader(bodies[i%chains]))
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
		b.ReportMetric(float64(n.Load())/b.Elapsed().Seconds(), "lookups/s")
	}
	b.Run("kvsp", func(b *testing.B) { run(b, s.URL("/is/lookup")) })
	b.Run("plain-encoding-json", func(b *testing.B) { run(b, "https://"+ln.Addr().String()+"/lookup") })
}
