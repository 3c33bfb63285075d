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
	if err := server.MountRole(r, server.RoleController, map[string]server.HandlerFunc{
		"PUT instances/{instance}/status":   c.leading(c.putStatus),
		"PUT sessions/{session}/checkpoint": c.leading(c.putCheckpoint),
	}); err != nil {
		return err
	}
	r.Handle("POST", "place", server.Route{Roles: []server.Role{server.RoleClient}, MaxBody: 8 << 20}, c.leading(c.place))
	return nil
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
			if self, err := url.Parse(c.cfg.Self); err == nil && strings.HasPrefix(r.URL.Path, self.Path) {
				w.Header().Set("Location", *l+strings.TrimPrefix(r.URL.Path, self.Path))
				w.Header().Set("Cache-Control", "no-store")
				w.WriteHeader(http.StatusTemporaryRedirect)
				return nil
			}
		}
		w.Header().Set("Retry-After", "1")
		return ErrNotLeader
	}
}

func (c *Controller) putStatus(w http.ResponseWriter, r *http.Request) error {
	var st kvsp.InstanceStatus
	if err := server.DecodeJSON(r, &st); err != nil {
		return err
	}
	if !server.PrincipalFrom(r.Context()).SpeaksFor(st.Instance) {
		return fmt.Errorf("%w: this identity does not speak for %s", kvsp.ErrForbidden, st.Instance)
	}
	if r.PathValue("instance") != kvsp.ResourceID(st.Instance) {
		return fmt.Errorf("%w: the path's instance id is not the record's (R-ST-2)", kvsp.ErrInvalid)
	}
	state, err := c.reg.Put(&st)
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
