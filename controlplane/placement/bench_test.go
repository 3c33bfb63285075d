package placement

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
)

// discard accepts every directive and state change: the benchmark measures
// the PC's decisions, not the instances.
type discard struct{}

func (discard) Prefetch(context.Context, string, *kvsp.PrefetchDirective) error { return nil }
func (discard) SetState(context.Context, string, kvsp.InstanceState) error      { return nil }
func (discard) Resume(context.Context, string, *kvsp.ResumeRequest) error       { return nil }
func (discard) Reshard(context.Context, string, *kvsp.Reshard) (*kvsp.ReshardAck, error) {
	return nil, errors.New("no instances here")
}

// BenchmarkPlace: placement decisions with 64 instances (links to 16
// holders) and 128-block prompts of which 64 blocks are cached, the IS
// in-process (the target: at least 5,000 decisions/s on 2 cores).
// Each decision computes the prompt's Block Keys, looks them up, costs 64
// instances and sends a directive.
func BenchmarkPlace(b *testing.B) {
	key, _ := kvsp.NewScopeKey(make([]byte, 32))
	mem := index.NewMemory(time.Minute)
	defer mem.Close()
	const instances, holders, blocks, cached, prompts = 64, 16, 128, 64, 256
	c, err := New(Config{Scopes: []kvsp.ScopeKey{key}, BlockTokens: map[kvsp.CompatID]int{compatA: 16},
		Index: BackendIndex{B: mem}, Instances: discard{}, MaxPending: 1 << 30,
		// The decision alone: one principal's placements, never generated,
		// hold no room past their making (the admission control's share
		// and queue limits have their own tests, RELIABILITY L5).
		MaxShare: 1, PlacementTTL: time.Nanosecond})
	if err != nil {
		b.Fatal(err)
	}
	var links []kvsp.Link
	for h := 0; h < holders; h++ {
		links = append(links, kvsp.Link{Holder: fmt.Sprintf("https://h%d.example/kvsp/", h), MbitPerS: 200000, RTTUs: 12})
	}
	for i := 0; i < instances; i++ {
		st := status(fmt.Sprintf("https://ii%d.example/kvsp/", i), 1, kvsp.StateActive, compatA)
		st.Links, st.Queued, st.BatchSize, st.TTLMs = links, uint64(i%4), 64, 1<<40
		if _, err := c.Registry().Put(st); err != nil {
			b.Fatal(err)
		}
	}
	reqs := make([]*kvsp.PlaceRequest, prompts)
	for p := range reqs {
		tokens := make([]uint32, blocks*16)
		for i := range tokens {
			tokens[i] = uint32(p*1000003 + i)
		}
		reqs[p] = &kvsp.PlaceRequest{ScopeID: key.ID(), CompatID: compatA, Tokens: tokens, MaxTokens: 128}
		keys, _ := kvsp.BlockKeys(key, compatA, 16, tokens)
		for i, k := range keys[:cached] {
			r := &kvsp.ReplicaRecord{BlockKey: k, CompatID: compatA, ScopeID: key.ID(), Holder: links[(p+i)%holders].Holder, Codec: 1,
				Size: 2097152, Digest: kvsp.Digest{1}, LayerDigests: make([]kvsp.LayerDigest, 32), TTLMs: 600000,
				Residency: []kvsp.Residency{{Tier: kvsp.TierHost, Layers: kvsp.LayerRange{0, 31}}}}
			mem.Put(context.Background(), r, time.Hour, index.PutOptions{})
		}
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			out, err := c.Place(ctx, reqs[i%prompts])
			if err != nil || out.Matched != cached || out.Directive == nil {
				b.Errorf("place: %+v %v", out, err)
				return
			}
			i++
		}
	})
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
}
