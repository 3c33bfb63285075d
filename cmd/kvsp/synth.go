package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
)

// synthParams shape a synthetic workload (--trace synth[:k=v,...]): a
// library of documents, each a chain of blocks shared by every request
// that retrieves it, chosen with a Zipf popularity (a few hot, many
// cold, some reused an hour apart), each request's document followed by
// blocks of its own. Its defaults are the longer workload issue 47 found
// sharing stop on: about 12,000 requests over an hour of trace time, 24
// blocks a request, some 190,000 distinct blocks (four times the
// embedded trace's), and an infinite-cache bound near 0.35.
type synthParams struct {
	Requests   int     // requests
	Minutes    float64 // trace time they arrive over (Poisson)
	Docs       int     // documents in the library
	Zipf       float64 // popularity exponent s > 1 (rank k drawn with weight k^-s)
	DocBlocks  int     // mean blocks of a document (uniform 1..2*mean-1)
	TailBlocks int     // mean blocks of a request's own (uniform 1..2*mean-1)
	Seed       uint64
}

var defaultSynth = synthParams{Requests: 12031, Minutes: 59, Docs: 2000, Zipf: 1.1, DocBlocks: 10, TailBlocks: 14, Seed: 47}

// parseSynth reads "synth" or "synth:requests=N,minutes=M,...".
func parseSynth(spec string) (synthParams, error) {
	p := defaultSynth
	_, args, _ := strings.Cut(spec, ":")
	if args == "" {
		return p, nil
	}
	for _, kv := range strings.Split(args, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return p, fmt.Errorf("synth: %q: want key=value", kv)
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || f <= 0 || math.IsInf(f, 0) {
			return p, fmt.Errorf("synth: %s: %q: want a positive number", k, v)
		}
		switch k {
		case "requests":
			p.Requests = int(f)
		case "minutes":
			p.Minutes = f
		case "docs":
			p.Docs = int(f)
		case "zipf":
			p.Zipf = f
		case "doc-blocks":
			p.DocBlocks = int(f)
		case "tail-blocks":
			p.TailBlocks = int(f)
		case "seed":
			p.Seed = uint64(f)
		default:
			return p, fmt.Errorf("synth: unknown key %q (requests, minutes, docs, zipf, doc-blocks, tail-blocks, seed)", k)
		}
	}
	switch {
	case p.Requests < 1 || p.Requests > 1e6:
		return p, fmt.Errorf("synth: requests: 1..1000000")
	case p.Docs < 1 || p.Docs > 1e6 || p.DocBlocks < 1 || p.TailBlocks < 1 || p.DocBlocks+p.TailBlocks > 512:
		return p, fmt.Errorf("synth: docs 1..1000000, doc-blocks and tail-blocks at least 1, 512 together at most")
	case p.Zipf <= 1:
		return p, fmt.Errorf("synth: zipf: above 1")
	}
	return p, nil
}

// synthTrace generates p's requests: deterministic in p (its seed).
func synthTrace(p synthParams) []traceRequest {
	r := rand.New(rand.NewPCG(p.Seed, 0x73796e7468)) // "synth"
	zipf := rand.NewZipf(r, p.Zipf, 1, uint64(p.Docs-1))
	docs := make([][]int64, p.Docs) // each document's block ids, given at its first use
	var next int64
	fresh := func(n int) []int64 {
		ids := make([]int64, n)
		for i := range ids {
			ids[i] = next
			next++
		}
		return ids
	}
	times := make([]float64, p.Requests)
	for i := range times {
		times[i] = r.Float64() * p.Minutes * 60_000 // ms
	}
	slices.Sort(times)
	out := make([]traceRequest, p.Requests)
	for i := range out {
		d := zipf.Uint64()
		if docs[d] == nil {
			docs[d] = fresh(1 + r.IntN(2*p.DocBlocks-1))
		}
		ids := append(slices.Clone(docs[d]), fresh(1+r.IntN(2*p.TailBlocks-1))...)
		out[i] = traceRequest{Timestamp: math.Round(times[i]), HashIDs: ids, OutputLength: 1 + r.IntN(200),
			InputLength: (len(ids)-1)*traceBlockTokens + 1 + r.IntN(traceBlockTokens)}
	}
	return out
}
