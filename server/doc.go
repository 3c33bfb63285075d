// Package server is the one secure HTTP stack every KVSP role mounts its
// handlers on (spec sections "HTTP Usage" and "Security Considerations";
// CONFORMANCE.md R-HTTP-*, R-SEC-*, R-ERR-*; decisions,
//
//
// A role is a set of routes under its base URI path. Each route names the
// roles allowed to call it, a body limit and a deadline, and a handler that
// returns an error:
//
//	r := srv.Mount("/is/")
//	r.Handle("POST", "lookup", server.Route{Roles: []server.Role{server.RoleController, server.RoleClient}, MaxBody: 1 << 20},
//		func(w http.ResponseWriter, req *http.Request) error {
//			var q kvsp.LookupRequest
//			if err := server.DecodeJSON(req, &q); err != nil {
//				return err
//			}
//			if !server.PrincipalFrom(req.Context()).MayUseScope(q.ScopeID) {
//				return kvsp.ErrScopeDenied // before any probe of the index
//			}
//			...
//			return server.WriteJSON(w, http.StatusOK, &resp)
//		})
//
// Before a handler runs, the adapter has authenticated the client (TLS 1.3,
// a certificate chaining to the current CA bundle, checked on every
// handshake including resumptions) and authorized its identity against the
// current policy for the route's roles. An error becomes an
// application/problem+json response with the KVSP type and status (one
// table, kvsp.ProblemFor); every response that is not block data carries
// Cache-Control: no-store.
package server
