package client

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/kvsp/kvsp"
)

// RunSession places a request with the PC (group) ctl and runs it, delivering
// each output index exactly once, in order, to deliver (spec "Session
// Checkpoints and Migration", R-SES-5, R-SES-8, R-SES-9, R-SES-14, R-SES-16):
// tokens of an epoch lower than one already seen are discarded, and so are
// indices already delivered. When the token stream ends before its end
// (the instance failed), it asks the PC where the session continues
// (POST place with the session: the PC migrates it once the failure is
// detected) and resumes the stream from the first index it lacks. An
// error deliver returns ends the session: RunSession returns it.
// retry bounds the wait between attempts, the first placement's too when
// the PC cannot be reached or answers 502, 503 or 504. It returns the
// session id, why its output ended and how its prompt was served.
func (c *Client) RunSession(ctx context.Context, ctl *Controller, q *kvsp.PlaceRequest, retry time.Duration, deliver func(index uint64, token uint32) error) (SessionResult, error) {
	return c.RunSessionWithin(ctx, ctl, q, retry, 0, deliver)
}

// RunSessionWithin is RunSession that waits at most wait (0: as long as
// ctx allows) for a placement: the first, while the PC answers 429, 502,
// 503 or 504 or cannot be reached, and each after a stream ended early,
// while the PC has not moved the session. Past it, it returns the last
// answer (a front end answers 503 and the client comes back later).
func (c *Client) RunSessionWithin(ctx context.Context, ctl *Controller, q *kvsp.PlaceRequest, retry, wait time.Duration, deliver func(index uint64, token uint32) error) (SessionResult, error) {
	var res SessionResult
	expired := func(since time.Time) bool { return wait > 0 && time.Since(since) >= wait }
	start := time.Now()
	at, err := ctl.Place(ctx, q)
	for err != nil && transient(err) { // the PC is restarting, or unreachable for a moment
		if expired(start) {
			return res, err
		}
		select {
		case <-ctx.Done():
			return res, errors.Join(err, ctx.Err())
		case <-time.After(retry):
		}
		at, err = ctl.Place(ctx, q)
	}
	if err != nil {
		return res, err
	}
	session := at.Session
	res.Session = session
	cont := *q
	cont.Session = &session
	var next, maxEpoch uint64
	for {
		from := next
		done, err := c.Instance(at.Instance).Stream(ctx, &kvsp.GenerateRequest{Session: session, Epoch: at.Epoch, ScopeID: q.ScopeID, CompatID: q.CompatID,
			Tokens: q.Tokens, MaxTokens: q.MaxTokens, Sampler: q.Sampler, From: &from, Grant: at.Grant}, func(t kvsp.GeneratedToken) error {
			if t.Prefill != nil && res.Prefill == nil {
				res.Prefill = t.Prefill // the first instance's: how the prompt was served
			}
			switch {
			case t.Epoch < maxEpoch: // R-SES-9
				return nil
			case t.Index < next: // a duplicate (R-SES-5)
				maxEpoch = max(maxEpoch, t.Epoch)
				return nil
			case t.Index > next:
				return fmt.Errorf("%w: token %d arrived before %d", kvsp.ErrInvalid, t.Index, next)
			}
			maxEpoch = max(maxEpoch, t.Epoch)
			if err := deliver(t.Index, t.Token); err != nil {
				return deliverError{err}
			}
			next++
			return nil
		})
		if err == nil {
			res.Finish = done.Finish
			return res, nil
		}
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		var de deliverError
		if errors.As(err, &de) {
			return res, de.err // the caller's: it stops the session (the instance sees its front end leave)
		}
		var p *kvsp.Problem
		if errors.Is(err, kvsp.ErrInvalid) || errors.As(err, &p) && p.Status >= 400 && p.Status < 500 && p.Status != 403 && p.Status != 404 && p.Status != 409 && p.Status != 429 {
			// Refused, not failed: asking the PC again changes nothing (a
			// 403, 404 or 409 may say the session moved: a grant of its
			// former placement, or an instance that no longer has it; a
			// 429, wait).
			return res, err
		}
		c.log.Debug("session stream ended early; asking the PC where it continues", "session", session.String(), "instance", at.Instance, "epoch", at.Epoch, "next", next, "err", err)
		// Where does the session continue? The PC answers the same
		// instance until it has detected the failure.
		asked := time.Now()
		for {
			select {
			case <-ctx.Done():
				return res, ctx.Err()
			case <-time.After(retry):
			}
			if expired(asked) {
				return res, fmt.Errorf("%w: session %s not moved within %s: %v", kvsp.ErrUnavailable, session, wait, err)
			}
			moved, err := ctl.Place(ctx, &cont)
			if errors.Is(err, kvsp.ErrInvalidState) {
				return res, err // finished: nothing continues it
			}
			if err == nil && (moved.Epoch > at.Epoch || moved.Instance != at.Instance) {
				c.log.Debug("session continues", "session", session.String(), "instance", moved.Instance, "epoch", moved.Epoch)
				at = moved
				break
			}
			if c.log.Enabled(ctx, slog.LevelDebug) {
				if err != nil {
					c.log.Debug("session not moved yet", "session", session.String(), "err", err)
				} else {
					c.log.Debug("session not moved yet", "session", session.String(), "instance", moved.Instance, "epoch", moved.Epoch)
				}
			}
		}
	}
}

// deliverError carries an error of the caller's deliver through the
// stream, so that RunSession returns it rather than resume elsewhere.
type deliverError struct{ err error }

func (e deliverError) Error() string { return e.err.Error() }
func (e deliverError) Unwrap() error { return e.err }

// SessionResult is how a session ran.
type SessionResult struct {
	Session kvsp.UUID
	// Finish is why its output ended: stop (the model's
	// end-of-generation token), length (max_tokens).
	Finish kvsp.FinishReason
	// Prefill is how its first instance served the prompt: tokens whose
	// KV came from a cache, and tokens computed (nil if no line said).
	Prefill *kvsp.PrefillInfo
}

// transient reports an error worth another try of the same request: no
// answer (a transport error), or 429 (the PC's share of room, RELIABILITY
// L5), 502, 503, 504.
func transient(err error) bool {
	var p *kvsp.Problem
	if errors.As(err, &p) {
		return p.Status == 429 || p.Status == 502 || p.Status == 503 || p.Status == 504
	}
	return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}
