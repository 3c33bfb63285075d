package instance

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// grants are the placement grants the agent took (kvsp.Grant): an
// instance runs only what the PC placed on it (RELIABILITY S14: the red
// team's prompts sent straight to instances made llama.cpp evaluate 57,213
// tokens), and each placement once: a grant is taken by one generate.
// The grants taken since the last status record the PC acknowledged are
// reported in the next one ("started"), so the PC stops counting them as
// placements holding room (RELIABILITY L5).
type grants struct {
	mu      sync.Mutex
	used    map[kvsp.GrantID]time.Time // taken, until it expires
	swept   time.Time
	started []kvsp.GrantID
}

// placed takes q's grant (checkGrant, then takeGrant) and returns q's
// Block Keys: the grant's MAC and members are checked before any work the
// request's size decides (its Block Keys, the engine's), the prompt once
// its keys are known.
func (a *Agent) placed(q *kvsp.GenerateRequest, key kvsp.ScopeKey) ([]kvsp.BlockKey, error) {
	now := time.Now()
	g, err := a.checkGrant(q, key, now)
	if err != nil {
		a.m.grants.WithLabelValues("refused").Inc()
		return nil, err
	}
	bt := int(a.g.BlockTokens)
	keys, err := kvsp.BlockKeys(key, q.CompatID, bt, q.Tokens)
	if err != nil {
		return nil, err
	}
	if err := a.takeGrant(g, kvsp.PromptDigest(keys, q.Tokens[len(keys)*bt:]), now); err != nil {
		a.m.grants.WithLabelValues("refused").Inc()
		return nil, err
	}
	a.m.grants.WithLabelValues("taken").Inc()
	a.kickStatus() // the PC stops counting its placement as holding room
	return keys, nil
}

// checkGrant verifies q's grant, before any engine work: sealed by the PC
// under the scope's key, for this instance in this epoch, for q's session,
// epoch, scope and model, at most its max_tokens, unexpired and not taken
// before. The prompt is checked by take, once its Block Keys are known.
func (a *Agent) checkGrant(q *kvsp.GenerateRequest, key kvsp.ScopeKey, now time.Time) (*kvsp.Grant, error) {
	g, err := kvsp.OpenGrant(key, q.Grant)
	switch {
	case err != nil:
		return nil, err
	case g.Instance != a.cfg.Base || g.InstanceEpoch != a.epoch:
		return nil, fmt.Errorf("%w: it places the request on another instance", kvsp.ErrGrant)
	case g.Session != q.Session || g.Epoch != q.Epoch:
		return nil, fmt.Errorf("%w: it is another session's, or another epoch's", kvsp.ErrGrant)
	case g.ScopeID != q.ScopeID || g.CompatID != q.CompatID:
		return nil, fmt.Errorf("%w: it is another scope's or model's", kvsp.ErrGrant)
	case q.MaxTokens > g.MaxTokens:
		return nil, fmt.Errorf("%w: max_tokens past the placement's %d", kvsp.ErrGrant, g.MaxTokens)
	case !now.Before(g.Expires):
		return nil, fmt.Errorf("%w: it expired; place the request again", kvsp.ErrGrant)
	}
	a.grants.mu.Lock()
	defer a.grants.mu.Unlock()
	if _, ok := a.grants.used[g.ID]; ok {
		return nil, fmt.Errorf("%w: this placement's generate was taken already; place the request again", kvsp.ErrGrant)
	}
	return g, nil
}

// takeGrant takes g for a request whose prompt has digest prompt: the
// prompt the PC placed, and no generate took it before.
func (a *Agent) takeGrant(g *kvsp.Grant, prompt [32]byte, now time.Time) error {
	if prompt != g.Prompt {
		return fmt.Errorf("%w: the tokens are not the placed prompt", kvsp.ErrGrant)
	}
	gs := &a.grants
	gs.mu.Lock()
	defer gs.mu.Unlock()
	if _, ok := gs.used[g.ID]; ok {
		return fmt.Errorf("%w: this placement's generate was taken already; place the request again", kvsp.ErrGrant)
	}
	if gs.used == nil {
		gs.used = map[kvsp.GrantID]time.Time{}
	}
	if now.Sub(gs.swept) > time.Second { // what expired can no longer be taken: forgotten
		for id, exp := range gs.used {
			if !now.Before(exp) {
				delete(gs.used, id)
			}
		}
		gs.swept = now
	}
	gs.used[g.ID] = g.Expires
	if len(gs.started) >= kvsp.MaxStarted { // the PC counts the oldest as expired by now
		gs.started = slices.Delete(gs.started, 0, 1)
	}
	gs.started = append(gs.started, g.ID)
	return nil
}

// startedGrants returns the grants taken since the last acknowledged
// status record.
func (a *Agent) startedGrants() []kvsp.GrantID {
	a.grants.mu.Lock()
	defer a.grants.mu.Unlock()
	return slices.Clone(a.grants.started)
}

// ackStarted drops the grants a status record the PC accepted reported.
func (a *Agent) ackStarted(ids []kvsp.GrantID) {
	if len(ids) == 0 {
		return
	}
	a.grants.mu.Lock()
	defer a.grants.mu.Unlock()
	done := make(map[kvsp.GrantID]struct{}, len(ids))
	for _, id := range ids {
		done[id] = struct{}{}
	}
	a.grants.started = slices.DeleteFunc(a.grants.started, func(id kvsp.GrantID) bool { _, ok := done[id]; return ok })
}
