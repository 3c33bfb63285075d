package placement

import (
	"context"
	"sync"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/index"
)

// BackendIndex is the Index of a PC co-located with its IS: lookups go to
// the IS's backend in-process (the spec allows combining roles).
type BackendIndex struct {
	B index.Backend
}

var results = sync.Pool{New: func() any { return new(index.Result) }}

// Lookup implements Index.
func (x BackendIndex) Lookup(ctx context.Context, q *kvsp.LookupRequest) (*kvsp.LookupResponse, error) {
	res := results.Get().(*index.Result)
	defer results.Put(res)
	if err := x.B.Lookup(ctx, q.ScopeID, q.CompatID, q.BlockKeys, res); err != nil {
		return nil, err
	}
	out := &kvsp.LookupResponse{Matched: len(res.Replicas), Replicas: make([][]kvsp.ReplicaRecord, len(res.Replicas))}
	for i, r := range res.Replicas {
		out.Replicas[i] = append([]kvsp.ReplicaRecord(nil), r...) // the Result is reused
	}
	return out, nil
}
