package client

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"sync/atomic"

	"github.com/kvsp/kvsp"
)

// Index is a client of an Index Service.
type Index struct {
	c    *Client
	base string
}

// Index returns a client of the IS at base.
func (c *Client) Index(base string) *Index { return &Index{c, base} }

// Publish publishes or refreshes a replica record (PUT
// replicas/{holder-id}/{block_key}); it returns the stored record, whose
// ttl_ms is the effective (capped) TTL, and whether it was created (201)
// rather than refreshed.
func (x *Index) Publish(ctx context.Context, rec *kvsp.ReplicaRecord) (*kvsp.ReplicaRecord, bool, error) {
	var out kvsp.ReplicaRecord
	url := join(x.base, "replicas/"+kvsp.ResourceID(rec.Holder)+"/"+rec.BlockKey.String())
	st, _, err := x.c.doJSON(ctx, http.MethodPut, url, rec, &out)
	if err != nil {
		return nil, false, err
	}
	return &out, st == http.StatusCreated, nil
}

// StateDigest states a block's digest as its producer (PUT
// producers/{block_key}, kvsp's extension): with the IS's
// producer_digests, its holders' records are accepted only with this
// digest. It returns the stored record (ttl_ms capped).
func (x *Index) StateDigest(ctx context.Context, rec *kvsp.ProducerRecord) (*kvsp.ProducerRecord, error) {
	var out kvsp.ProducerRecord
	if _, _, err := x.c.doJSON(ctx, http.MethodPut, join(x.base, "producers/"+rec.BlockKey.String()), rec, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Withdraw withdraws a record; a record the IS does not know counts as
// withdrawn.
func (x *Index) Withdraw(ctx context.Context, holder string, key kvsp.BlockKey) error {
	url := join(x.base, "replicas/"+kvsp.ResourceID(holder)+"/"+key.String())
	_, _, err := x.c.doJSON(ctx, http.MethodDelete, url, nil, nil)
	if errors.Is(err, kvsp.ErrNotFound) {
		return nil
	}
	return err
}

// Lookup sends a longest-prefix lookup (POST lookup).
func (x *Index) Lookup(ctx context.Context, q *kvsp.LookupRequest) (*kvsp.LookupResponse, error) {
	var out kvsp.LookupResponse
	if _, _, err := x.c.doJSON(ctx, http.MethodPost, join(x.base, "lookup"), q, &out); err != nil {
		return nil, err
	}
	if out.Matched > len(q.BlockKeys) {
		return nil, fmt.Errorf("%w: lookup matched %d of %d keys", kvsp.ErrInvalid, out.Matched, len(q.BlockKeys))
	}
	return &out, nil
}

// Controller is a client of a Placement Controller, or of a group of
// them of which one leads (a standby redirects to the leader or answers
// 503): a call goes to the PC that answered last, and moves on to the
// next when that one is unreachable or a standby that cannot redirect.
type Controller struct {
	c     *Client
	bases []string
	cur   atomic.Int32
}

// Controller returns a client of the PC at base, with the other members
// of its group, if any, to fail over to.
func (c *Client) Controller(base string, others ...string) *Controller {
	return &Controller{c: c, bases: append([]string{base}, others...)}
}

// call runs do against each PC in turn from the current one, until one
// answers: it moves on when a PC is a standby (503 with the standby
// member) or when the request was never written to it (no connection,
// or one that hung); an idempotent request also moves on after any
// transport error. A leader's own error is final. The current PC changes
// only to one that answered.
func (x *Controller) call(ctx context.Context, idempotent bool, do func(ctx context.Context, base string) error) error {
	start := int(x.cur.Load())
	var err error
	for i := range x.bases {
		k := (start + i) % len(x.bases)
		var wrote atomic.Bool
		tctx := httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: func(httptrace.WroteRequestInfo) { wrote.Store(true) }})
		err = do(tctx, x.bases[k])
		var p *kvsp.Problem
		answered := err == nil || errors.As(err, &p)
		if !failOver(ctx, err, idempotent, wrote.Load()) {
			if answered {
				x.cur.Store(int32(k))
			}
			return err
		}
	}
	return err
}

// failOver reports an error after which another PC of the group may be
// tried: nothing was done by a leader.
func failOver(ctx context.Context, err error, idempotent, wrote bool) bool {
	if err == nil || ctx.Err() != nil {
		return false
	}
	var p *kvsp.Problem
	if errors.As(err, &p) {
		standby, _ := p.Extensions["standby"].(bool)
		return p.Status == http.StatusServiceUnavailable && standby
	}
	return !wrote || idempotent // a transport error: the request never left, or may be sent again
}

// PutStatus sends an Instance Status Record; the answer carries the state
// the PC assigns (R-ST-9, A-19).
func (x *Controller) PutStatus(ctx context.Context, s *kvsp.InstanceStatus) (*kvsp.StateBody, error) {
	var out kvsp.StateBody
	err := x.call(ctx, true, func(ctx context.Context, base string) error {
		_, _, err := x.c.doJSON(ctx, http.MethodPut, join(base, "instances/"+kvsp.ResourceID(s.Instance)+"/status"), s, &out)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// Place asks where a request should run (kvsp's placement API, POST
// place; not retried at the same PC: each call creates a session).
func (x *Controller) Place(ctx context.Context, q *kvsp.PlaceRequest) (*kvsp.PlaceResponse, error) {
	var out kvsp.PlaceResponse
	wire := *q // the prompt as tokens_le32 (kvsp.TokensLE32)
	if wire.Tokens != nil && wire.TokensLE32 == nil {
		wire.Tokens, wire.TokensLE32 = nil, kvsp.TokensLE32(q.Tokens)
	}
	err := x.call(ctx, false, func(ctx context.Context, base string) error {
		_, _, err := x.c.doJSON(ctx, http.MethodPost, join(base, "place"), &wire, &out)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// UpdateMap moves a sequence-sharded context to its next map (PUT
// maps/{map}, kvsp's resharding API); it returns once the members
// committed.
func (x *Controller) UpdateMap(ctx context.Context, u *kvsp.MapUpdate) (*kvsp.MapUpdateResult, error) {
	var out kvsp.MapUpdateResult
	ctx = context.WithValue(ctx, onceKey{}, true) // a reshard is not repeated behind the caller's back
	err := x.call(ctx, false, func(ctx context.Context, base string) error {
		_, _, err := x.c.doJSON(ctx, http.MethodPut, join(base, "maps/"+url.PathEscape(u.Map.Map)), u, &out)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// PutCheckpoint sends a Session Checkpoint; a 2xx is the acknowledgement
//
func (x *Controller) PutCheckpoint(ctx context.Context, cp *kvsp.Checkpoint) (*kvsp.CheckpointAck, error) {
	var out kvsp.CheckpointAck
	err := x.call(ctx, true, func(ctx context.Context, base string) error {
		_, _, err := x.c.doJSON(ctx, http.MethodPut, join(base, "sessions/"+cp.Session.String()+"/checkpoint"), cp, &out)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &out, nil
}

// Instance is a client of an inference instance's directives.
type Instance struct {
	c    *Client
	base string
}

// Instance returns a client of the instance at base.
func (c *Client) Instance(base string) *Instance { return &Instance{c, base} }

// Prefetch posts a directive and returns the Location of its status
// resource (R-PF-2). POST is not retried: the directive id makes a manual
// retry idempotent.
func (x *Instance) Prefetch(ctx context.Context, d *kvsp.PrefetchDirective) (string, error) {
	st, hdr, err := x.c.doJSON(ctx, http.MethodPost, join(x.base, "prefetch"), d, nil)
	if err != nil {
		return "", err
	}
	if st != http.StatusAccepted || hdr.Get("Location") == "" {
		return "", fmt.Errorf("%w: prefetch answered %d without Location", kvsp.ErrInvalid, st)
	}
	return hdr.Get("Location"), nil
}

// PrefetchStatus reads a directive's state (GET prefetch/{id}).
func (x *Instance) PrefetchStatus(ctx context.Context, id kvsp.UUID) (*kvsp.PrefetchStatus, error) {
	var out kvsp.PrefetchStatus
	if _, _, err := x.c.doJSON(ctx, http.MethodGet, join(x.base, "prefetch/"+id.String()), nil, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Generate runs a placed request at the instance (kvsp's inference API,
// POST generate) and calls fn with each output token as it arrives. It
// returns nil once the stream's done line arrived, an error if the stream
// ends before it (the front end then resumes elsewhere).
func (x *Instance) Generate(ctx context.Context, q *kvsp.GenerateRequest, fn func(kvsp.GeneratedToken) error) error {
	_, err := x.Stream(ctx, q, fn)
	return err
}

// Stream is Generate that also returns the stream's done line: its
// Finish says why the output ended, its Index how many tokens the
// output has.
func (x *Instance) Stream(ctx context.Context, q *kvsp.GenerateRequest, fn func(kvsp.GeneratedToken) error) (kvsp.GeneratedToken, error) {
	var done kvsp.GeneratedToken
	err := x.stream(ctx, q, fn, &done)
	return done, err
}

func (x *Instance) stream(ctx context.Context, q *kvsp.GenerateRequest, fn func(kvsp.GeneratedToken) error, done *kvsp.GeneratedToken) error {
	wire := *q // the prompt as tokens_le32 (kvsp.TokensLE32)
	if wire.Tokens != nil && wire.TokensLE32 == nil {
		wire.Tokens, wire.TokensLE32 = nil, kvsp.TokensLE32(q.Tokens)
	}
	body, err := kvsp.Marshal(&wire)
	if err != nil {
		return err
	}
	resp, err := x.c.do(ctx, http.MethodPost, join(x.base, "generate"), http.Header{
		"Content-Type": {kvsp.MediaType}, "Accept": {kvsp.MediaTypeTokens + ", " + kvsp.MediaTypeProblem}}, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return ProblemFrom(resp)
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var t kvsp.GeneratedToken
		if err := kvsp.Decode(sc.Bytes(), &t); err != nil {
			return fmt.Errorf("%w: token stream: %v", kvsp.ErrInvalid, err)
		}
		if t.Done {
			*done = t
			return nil
		}
		if err := fn(t); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return fmt.Errorf("%w: the token stream ended before its end", kvsp.ErrUnavailable)
}

// Resume asks the instance to resume a session.
func (x *Instance) Resume(ctx context.Context, r *kvsp.ResumeRequest) error {
	url := join(x.base, "sessions/"+r.Checkpoint.Session.String()+"/resume")
	_, _, err := x.c.doJSON(ctx, http.MethodPost, url, r, nil)
	return err
}

// Reshard sends a plan, commit or abort; a plan returns once the
// instance loaded its fetch ranges.
func (x *Instance) Reshard(ctx context.Context, m *kvsp.Reshard) (*kvsp.ReshardAck, error) {
	var out kvsp.ReshardAck
	if _, _, err := x.c.doJSON(ctx, http.MethodPost, join(x.base, "reshard"), m, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// SetState changes the instance's lifecycle state.
func (x *Instance) SetState(ctx context.Context, s kvsp.InstanceState) (*kvsp.StateBody, error) {
	var out kvsp.StateBody
	if _, _, err := x.c.doJSON(ctx, http.MethodPut, join(x.base, "state"), &kvsp.StateBody{State: s}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}
