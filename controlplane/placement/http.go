package placement

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/server"
)

// Mount adds the PC's routes under r: the status and checkpoint PUTs of
// the resource table, and POST place for front ends (the client role, and
// the scope).
func (c *Controller) Mount(r *server.Router) error {
	c.policy.Store(r.Policy())
	if err := server.MountRole(r, server.RoleController, map[string]server.HandlerFunc{
		"PUT instances/{instance}/status":   c.leading(c.putStatus),
		"PUT sessions/{session}/checkpoint": c.leading(c.putCheckpoint),
	}); err != nil {
		return err
	}
	r.Handle("POST", "place", server.Route{Roles: []server.Role{server.RoleClient}, MaxBody: 8 << 20}, c.leading(c.place))
	r.Handle("PUT", "maps/{map}", server.Route{Roles: []server.Role{server.RoleClient}, MaxBody: 8 << 20}, c.leading(c.putMap))
	return nil
}

// putMap moves a sequence-sharded context to its next map (kvsp's
// resharding API over Reshard): 200 with the committed map, 409
// kvsp-plan-conflict for a version that is not the next, 503 when a
// member did not acknowledge in time (everything aborted, the map
// unchanged).
func (c *Controller) putMap(w http.ResponseWriter, r *http.Request) error {
	var u kvsp.MapUpdate
	if err := server.DecodeJSON(r, &u); err != nil {
		return err
	}
	if !server.PrincipalFrom(r.Context()).MayUseScope(u.ScopeID) {
		return fmt.Errorf("%w: map update", kvsp.ErrScopeDenied) // before anything is looked at
	}
	if r.PathValue("map") != u.Map.Map {
		return fmt.Errorf("%w: the path's map is not the body's", kvsp.ErrInvalid)
	}
	res, err := c.Reshard(r.Context(), &ReshardRequest{Next: u.Map, ScopeID: u.ScopeID, CompatID: u.CompatID, Tokens: u.Tokens,
		Deadline: kvsp.Millis(u.DeadlineMs)})
	if err != nil {
		return err
	}
	return server.WriteJSON(w, http.StatusOK, &kvsp.MapUpdateResult{Map: u.Map, FetchedBytes: res.FetchedBytes})
}

// leading serves h while this controller leads; a standby redirects the
// request to the leader (307 keeps the method and body) when it knows
// one, and answers 503 with Retry-After otherwise (RunHA).
func (c *Controller) leading(h server.HandlerFunc) server.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		if !c.standby.Load() {
			return h(w, r)
		}
		if l := c.leader.Load(); l != nil && *l != c.cfg.Self && c.cfg.Self != "" {
			if self, err := url.Parse(c.cfg.Self); err == nil && strings.HasPrefix(r.URL.EscapedPath(), self.EscapedPath()) {
				loc := *l + strings.TrimPrefix(r.URL.EscapedPath(), self.EscapedPath())
				if r.URL.RawQuery != "" {
					loc += "?" + r.URL.RawQuery
				}
				w.Header().Set("Location", loc)
				w.Header().Set("Cache-Control", "no-store")
				w.WriteHeader(http.StatusTemporaryRedirect)
				return nil
			}
		}
		w.Header().Set("Retry-After", "1")
		// The standby member tells clients of the group to try another
		// PC (client.Controller fails over on it, and only on it).
		return ErrNotLeader
	}
}

func (c *Controller) putStatus(w http.ResponseWriter, r *http.Request) error {
	var st kvsp.InstanceStatus
	if err := server.DecodeJSON(r, &st); err != nil {
		return err
	}
	p := server.PrincipalFrom(r.Context())
	if !p.SpeaksFor(st.Instance) {
		return fmt.Errorf("%w: this identity does not speak for %s", kvsp.ErrForbidden, st.Instance)
	}
	if r.PathValue("instance") != kvsp.ResourceID(st.Instance) {
		return fmt.Errorf("%w: the path's instance id is not the record's (R-ST-2)", kvsp.ErrInvalid)
	}
	state, err := c.reg.PutFrom(&st, p.ID)
	if err != nil {
		return err
	}
	return server.WriteJSON(w, http.StatusOK, &kvsp.StateBody{State: state})
}

func (c *Controller) place(w http.ResponseWriter, r *http.Request) error {
	var q kvsp.PlaceRequest
	if err := server.DecodeJSON(r, &q); err != nil {
		return err
	}
	if !server.PrincipalFrom(r.Context()).MayUseScope(q.ScopeID) {
		return fmt.Errorf("%w: place", kvsp.ErrScopeDenied) // before any lookup
	}
	out, err := c.Place(r.Context(), &q)
	if err != nil {
		if err == ErrNoCapacity {
			w.Header().Set("Retry-After", "1")
		}
		return err
	}
	return server.WriteJSON(w, http.StatusOK, out)
}
