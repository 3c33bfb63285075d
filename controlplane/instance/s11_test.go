package instance_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
)

// rawCall sends one request with the identity id and returns the status
// and the body; a problem's "instance" (a request id, different every
// time) is dropped, so that two answers can be compared octet for octet.
func (w *rig) rawCall(t *testing.T, id, method, url string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, url, rd)
	if body != nil {
		req.Header.Set("Content-Type", kvsp.MediaType)
	}
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: w.tls(id), ForceAttemptHTTP2: true}}
	defer c.CloseIdleConnections()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if strings.HasPrefix(resp.Header.Get("Content-Type"), kvsp.MediaTypeProblem) {
		var m map[string]any
		if json.Unmarshal(b, &m) == nil {
			delete(m, "instance")
			b, _ = json.Marshal(m)
		}
	}
	return resp.StatusCode, b
}

// resumeB has the PC resume a session of scope B at ii1 (epoch 2): no
// complete prompt block, prompt_tail [9], two tokens generated.
func (w *rig) resumeB(t *testing.T, session kvsp.UUID) {
	t.Helper()
	cp := kvsp.Checkpoint{Session: session, Epoch: 1, CompatID: w.compat, ScopeID: w.scopeB.ID(), PromptBlocks: []kvsp.BlockKey{},
		PromptTail: []uint32{9}, Generated: []uint32{4242, 4343}, OutputOffset: 2,
		Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Step: 2, Deterministic: true}}
	if err := w.pc.Resume(context.Background(), &kvsp.ResumeRequest{Epoch: 2, Checkpoint: cp}); err != nil {
		t.Fatal(err)
	}
}

// TestS11_SessionsNeverCrossScopes (RELIABILITY S11): the PC resumes a
// session of scope B at an instance; a client of scope A naming that
// session (with its own scope, with the session's prompt tail as tokens,
// at its epoch) is answered exactly as for a session id nobody uses:
// 404 kvsp-not-found, the same body, nothing streamed; at epoch 1 it
// gets a new session of its own, the same output as under an unused id.
// Paired positive: scope B's client continues the session from its
// checkpoint (4242, 4343 first). The same scope with another prompt
// (tail or blocks) is 409 saying which; another model 409
// kvsp-incompatible. Directives are found by id only by a controller of
// their scope; a prefetch, resume or reshard for a scope the caller is
// not authorized for is 403 before anything is looked at (R-PF-16).
func TestS11_SessionsNeverCrossScopes(t *testing.T) {
	w := newRig(t, rigOptions{scopeB: true})
	session := kvsp.NewUUID()
	w.resumeB(t, session)
	gen := w.url("/ii1/") + "generate"
	req := func(scope kvsp.ScopeID, id kvsp.UUID, epoch uint64, tokens ...uint32) *kvsp.GenerateRequest {
		return w.granted(t, &kvsp.GenerateRequest{Session: id, Epoch: epoch, ScopeID: scope, CompatID: w.compat, Tokens: tokens, MaxTokens: 4})
	}
	a := w.scopeKey.ID()

	// Scope A, B's session id: exactly an unknown session.
	unknownStatus, unknown := w.rawCall(t, kvsptest.ClientA, "POST", gen, req(a, kvsp.NewUUID(), 2, 1, 2, 3))
	if unknownStatus != 404 || !bytes.Contains(unknown, []byte("kvsp-not-found")) {
		t.Fatalf("an unknown session at epoch 2: %d %s", unknownStatus, unknown)
	}
	for _, tokens := range [][]uint32{{1, 2, 3}, {9}} {
		st, body := w.rawCall(t, kvsptest.ClientA, "POST", gen, req(a, session, 2, tokens...))
		if st != unknownStatus || !bytes.Equal(body, unknown) {
			t.Fatalf("scope A naming scope B's session, tokens %v: %d %s; an unknown session gets %d %s", tokens, st, body, unknownStatus, unknown)
		}
		if bytes.Contains(body, []byte("4242")) {
			t.Fatal("scope B's output reached scope A")
		}
	}
	// At epoch 1 the id names a new session of scope A: its own output,
	// as under an id nobody uses.
	run := func(id string, q *kvsp.GenerateRequest) []uint32 {
		t.Helper()
		var got []uint32
		if err := w.as(id).Instance(w.url("/ii1/")).Generate(context.Background(), q, func(tk kvsp.GeneratedToken) error {
			got = append(got, tk.Token)
			return nil
		}); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		return got
	}
	mine := run(kvsptest.ClientA, req(a, session, 1, 9))
	fresh := run(kvsptest.ClientA, req(a, kvsp.NewUUID(), 1, 9))
	if !slices.Equal(mine, fresh) || slices.Contains(mine, 4242) {
		t.Fatalf("scope A at epoch 1 under scope B's id: %v; under a new id: %v", mine, fresh)
	}

	// The paired positive: scope B continues its session.
	b := w.scopeB.ID()
	cont := req(b, session, 2, 9)
	cont.From = new(uint64) // from index 0: the checkpoint's tokens again
	if got := run(clientB, cont); len(got) != 4 || got[0] != 4242 || got[1] != 4343 {
		t.Fatalf("scope B's own session: %v, want 4242 4343 first", got)
	}
	// Scope B, another prompt: 409 naming what differs; nothing streamed.
	other := kvsp.NewUUID()
	w.resumeB(t, other)
	if st, body := w.rawCall(t, clientB, "POST", gen, req(b, other, 2, 8)); st != 409 || !bytes.Contains(body, []byte("prompt_tail")) {
		t.Fatalf("another prompt tail: %d %s", st, body)
	}
	long := prompt(1)
	if st, body := w.rawCall(t, clientB, "POST", gen, req(b, other, 2, long...)); st != 409 || !bytes.Contains(body, []byte("prompt_blocks")) {
		t.Fatalf("a prompt with a block the checkpoint lacks: %d %s", st, body)
	}
	q := req(b, other, 2, 9)
	q.CompatID = kvsp.CompatID{7}
	if st, body := w.rawCall(t, clientB, "POST", gen, q); st != 409 || !bytes.Contains(body, []byte("kvsp-incompatible")) {
		t.Fatalf("another model: %d %s", st, body)
	}
	if st, body := w.rawCall(t, clientB, "POST", gen, req(b, other, 1, 9)); st != 409 || !bytes.Contains(body, []byte("kvsp-stale-epoch")) {
		t.Fatalf("the epoch before the resume: %d %s", st, body)
	}

	// Directives: another scope's is not found by id; one of a scope the
	// caller may not use is refused before anything else.
	d := w.directive(nil, nil, 1000)
	d.ScopeID = b
	d.Blocks = []kvsp.PrefetchBlock{{BlockKey: kvsp.BlockKey{1}, Sources: []string{w.url("/h1/")}}}
	if _, err := w.pc.Prefetch(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	st1, got := w.rawCall(t, pcA, "GET", w.url("/ii1/")+"prefetch/"+d.Directive.String(), nil)
	st2, none := w.rawCall(t, pcA, "GET", w.url("/ii1/")+"prefetch/"+kvsp.NewUUID().String(), nil)
	if st1 != 404 || st2 != 404 || !bytes.Equal(got, none) {
		t.Fatalf("scope B's directive to a controller of scope A: %d %s; an unknown one: %d %s", st1, got, st2, none)
	}
	if st, body := w.rawCall(t, kvsptest.PC, "GET", w.url("/ii1/")+"prefetch/"+d.Directive.String(), nil); st != 200 {
		t.Fatalf("scope B's directive to its controller: %d %s", st, body)
	}
	d2 := w.directive([]kvsp.BlockKey{{2}}, func(int) []string { return []string{w.url("/h1/")} }, 1000)
	d2.ScopeID = b
	if st, body := w.rawCall(t, pcA, "POST", w.url("/ii1/")+"prefetch", d2); st != 403 || !bytes.Contains(body, []byte("kvsp-scope-denied")) {
		t.Fatalf("a prefetch of scope B from a controller of scope A: %d %s", st, body)
	}
	if st, _ := w.rawCall(t, kvsptest.PC, "GET", w.url("/ii1/")+"prefetch/"+d2.Directive.String(), nil); st != 404 {
		t.Fatalf("the refused directive left state: %d", st)
	}
	unheld := w.directive([]kvsp.BlockKey{{3}}, func(int) []string { return []string{w.url("/h1/")} }, 1000)
	unheld.ScopeID = kvsp.ScopeID{0xee} // the caller is not authorized for it either
	if st, body := w.rawCall(t, kvsptest.PC, "POST", w.url("/ii1/")+"prefetch", unheld); st != 403 || !bytes.Contains(body, []byte("kvsp-scope-denied")) {
		t.Fatalf("a prefetch of a scope nobody here serves: %d %s", st, body)
	}
	cp := kvsp.Checkpoint{Session: kvsp.NewUUID(), Epoch: 1, CompatID: w.compat, ScopeID: b, PromptBlocks: []kvsp.BlockKey{},
		PromptTail: []uint32{9}, Generated: []uint32{}, Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Deterministic: true}}
	if st, body := w.rawCall(t, pcA, "POST", w.url("/ii1/")+"sessions/"+cp.Session.String()+"/resume", &kvsp.ResumeRequest{Epoch: 2, Checkpoint: cp}); st != 403 {
		t.Fatalf("a resume of scope B from a controller of scope A: %d %s", st, body)
	}

	// Reshard: a plan of scope B's map reaches a controller of scope A
	// only as a map it does not know.
	plan := &kvsp.Reshard{Kind: kvsp.ReshardPlan, Map: "ab12", From: 0, To: 1, DeadlineMs: 1000, ScopeID: b, Retain: []kvsp.TokenRange{}, Fetch: []kvsp.ReshardFetch{}, Release: []kvsp.TokenRange{}}
	if _, err := w.pc.Reshard(context.Background(), plan); err != nil {
		t.Fatal(err)
	}
	commit := map[string]any{"map": "ab12", "commit": 1} // the spec's form: no scope_id
	st1, got = w.rawCall(t, pcA, "POST", w.url("/ii1/")+"reshard", commit)
	st2, none = w.rawCall(t, pcA, "POST", w.url("/ii1/")+"reshard", map[string]any{"map": "cd34", "commit": 1})
	if st1 != 409 || !bytes.Equal(got, none) {
		t.Fatalf("a commit of scope B's map from a controller of scope A: %d %s; of an unknown map: %d %s", st1, got, st2, none)
	}
	planB := map[string]any{"map": "ab12", "from": 0, "to": 1, "deadline_ms": 1000, "retain": []any{}, "fetch": []any{}, "release": []any{}, "scope_id": b.String()}
	if st, body := w.rawCall(t, pcA, "POST", w.url("/ii1/")+"reshard", planB); st != 403 {
		t.Fatalf("a plan naming scope B from a controller of scope A: %d %s", st, body)
	}
	if _, err := w.pc.Reshard(context.Background(), &kvsp.Reshard{Kind: kvsp.ReshardCommit, Map: "ab12", Commit: 1, ScopeID: b}); err != nil {
		t.Fatalf("scope B's own commit: %v", err)
	}
	if v, _ := w.agent.ShardRanges(b, "ab12"); v != 1 {
		t.Fatalf("scope B's map at version %d after its commit", v)
	}
}

// TestS11_PlaceNeverCrossesScopes (RELIABILITY S11): at the PC, a place
// naming another scope's session id is a new session of the caller's own
// scope, exactly as an id nobody uses; the other scope's session is
// untouched. A place naming its own session with another prompt is 409,
// with another model 409 kvsp-incompatible; a checkpoint of another
// scope's session is 404.
func TestS11_PlaceNeverCrossesScopes(t *testing.T) {
	w := newRig(t, rigOptions{scopeB: true})
	w.runAgents(t, "/ii1/")
	ctx := context.Background()
	tokensB := prompt(2)
	pcB := w.as(clientB).Controller(w.url("/pc/"))
	outB, err := pcB.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: w.compat, Tokens: tokensB, MaxTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	before, ok := w.ctl.Session(w.scopeB.ID(), outB.Session)
	if !ok {
		t.Fatal("scope B's session is not at the PC")
	}
	pcAc := w.front.Controller(w.url("/pc/"))
	id := outB.Session
	outA, err := pcAc.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: []uint32{1, 2, 3}, MaxTokens: 4, Session: &id})
	if err != nil || outA.Session != id || outA.Epoch != 1 {
		t.Fatalf("scope A naming scope B's session id: %+v %v; want a new session of its own", outA, err)
	}
	fresh := kvsp.NewUUID()
	outU, err := pcAc.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeKey.ID(), CompatID: w.compat, Tokens: []uint32{1, 2, 3}, MaxTokens: 4, Session: &fresh})
	if err != nil || outU.Epoch != outA.Epoch || outU.Matched != outA.Matched || (outU.Directive == nil) != (outA.Directive == nil) {
		t.Fatalf("an unused id: %+v %v; scope B's id: %+v", outU, err, outA)
	}
	if after, _ := w.ctl.Session(w.scopeB.ID(), id); after.Epoch != before.Epoch || after.Instance != before.Instance || after.Prompt != before.Prompt {
		t.Fatalf("scope B's session changed: %+v, was %+v", after, before)
	}
	if _, ok := w.ctl.Session(w.scopeKey.ID(), id); !ok {
		t.Fatal("scope A's session under that id is not at the PC")
	}
	// Scope B's own session, another prompt or model.
	if _, err := pcB.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: w.compat, Tokens: append(slices.Clone(tokensB), 1), MaxTokens: 4, Session: &id}); !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("scope B's session with another prompt: %v", err)
	}
	if _, err := pcB.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: kvsp.CompatID{7}, Tokens: tokensB, MaxTokens: 4, Session: &id}); !errors.Is(err, kvsp.ErrIncompatible) {
		t.Fatalf("scope B's session with another model: %v", err)
	}
	if got, err := pcB.Place(ctx, &kvsp.PlaceRequest{ScopeID: w.scopeB.ID(), CompatID: w.compat, Tokens: tokensB, MaxTokens: 4, Session: &id}); err != nil || got.Epoch != before.Epoch || got.Instance != before.Instance {
		t.Fatalf("scope B continuing its session: %+v %v", got, err)
	}
	// A checkpoint that names scope A's session by id finds nothing of B's.
	keys, _ := kvsp.BlockKeys(w.scopeB, w.compat, 16, tokensB)
	cp := &kvsp.Checkpoint{Session: id, Epoch: 1, CompatID: w.compat, ScopeID: w.scopeB.ID(), PromptBlocks: keys, PromptTail: tokensB[len(keys)*16:],
		Generated: []uint32{5}, OutputOffset: 1, Sampler: kvsp.Sampler{Method: "greedy", Params: map[string]any{}, Step: 1, Deterministic: true}}
	if _, err := w.as(agentID).Controller(w.url("/pc/")).PutCheckpoint(ctx, cp); err != nil {
		t.Fatalf("scope B's own checkpoint: %v", err)
	}
	cp.ScopeID = kvsp.ScopeID{0xee}
	if _, err := w.as(agentID).Controller(w.url("/pc/")).PutCheckpoint(ctx, cp); !errors.Is(err, kvsp.ErrNotFound) {
		t.Fatalf("a checkpoint naming the id under another scope: %v", err)
	}
	cp.ScopeID = w.scopeB.ID()
	cp.PromptTail = []uint32{1}
	if _, err := w.as(agentID).Controller(w.url("/pc/")).PutCheckpoint(ctx, cp); !errors.Is(err, kvsp.ErrConflict) {
		t.Fatalf("a checkpoint of another prompt: %v", err)
	}
}

// TestReshardPlanInTheSpecsForm (issue 19 item 13; R-RSH-3..7, A-26): a
// plan with exactly the spec's members (map, from, to, deadline_ms,
// retain, fetch, release) is carried out: the model is the instance's, the
// scope the map's (here the instance's only one); the first plan of a
// map-less instance, 0 to 1 with nothing to fetch, is acknowledged and
// commits. A plan whose fetch needs Block Keys the plan does not carry is
// 400 naming the member, long before its deadline_ms.
func TestReshardPlanInTheSpecsForm(t *testing.T) {
	w := newRig(t, rigOptions{})
	url := w.url("/ii1/") + "reshard"
	plan := map[string]any{"map": "5pec", "from": 0, "to": 1, "deadline_ms": 5000, "retain": []any{}, "fetch": []any{}, "release": []any{}}
	st, body := w.rawCall(t, kvsptest.PC, "POST", url, plan)
	if st != 200 || !bytes.Contains(body, []byte(`"version":0`)) {
		t.Fatalf("the spec's first plan: %d %s", st, body)
	}
	if st, body := w.rawCall(t, kvsptest.PC, "POST", url, map[string]any{"map": "5pec", "commit": 1}); st != 200 || !bytes.Contains(body, []byte(`"version":1`)) {
		t.Fatalf("its commit: %d %s", st, body)
	}
	if v, _ := w.agent.ShardRanges(w.scopeKey.ID(), "5pec"); v != 1 {
		t.Fatalf("the map is at version %d", v)
	}
	fetch := map[string]any{"map": "f37c", "from": 0, "to": 1, "deadline_ms": 60000, "retain": []any{}, "release": []any{},
		"fetch": []any{map[string]any{"tokens": []int{0, 32}, "from": w.url("/ii2/")}}}
	start := time.Now()
	st, body = w.rawCall(t, kvsptest.PC, "POST", url, fetch)
	if st != 400 || !bytes.Contains(body, []byte("fetch[0].block_keys")) || time.Since(start) > 5*time.Second {
		t.Fatalf("a fetch without block keys: %d %s after %v", st, body, time.Since(start))
	}
}
