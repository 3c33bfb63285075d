package server

import "fmt"

// KVSPRoute is one row of the spec's resource table ("HTTP Usage", table
// "KVSP Resources") with the roles that may call it (decision A-5 and the
// policy rules):
//
//   - scope membership governs block GET/PUT, leases and lookups, so any
//     known principal may reach them and the handler checks the scope
//     before any probe; but only producers of KV (instances, and the
//     producer role) may PUT a block (RELIABILITY S13);
//   - holders publish and withdraw replicas (handler checks speaks_for);
//   - instances send status and checkpoints (handler checks speaks_for);
//   - only the controller sends prefetch, resume, reshard and state
//     (R-PF-12, R-SEC-15).
type KVSPRoute struct {
	Role    Role   // whose base URI the path is under
	Method  string // HTTP method
	Path    string // relative to the base, ServeMux wildcards
	Callers []Role // who may call it
	MaxBody int64  // body limit; 0: DefaultMaxBody; -1: no body
}

// Route returns the Route options of r.
func (r KVSPRoute) Route() Route { return Route{Roles: r.Callers, MaxBody: r.MaxBody} }

var anyone = []Role{RoleController, RoleIndex, RoleHolder, RoleInstance, RoleClient, RoleProducer}

// producers store blocks: the KV they computed, or copied after
// verifying it against its producer's digests.
var producers = []Role{RoleInstance, RoleProducer}

// MaxBlockBody bounds a block PUT (a 80-layer block of 16 tokens x 8 heads x
// 128 x fp32 is 80 MiB; holders may set their own).
const MaxBlockBody = 1 << 30

// MaxCheckpointBody bounds a Session Checkpoint's body (PUT checkpoint,
// POST resume): a session of 2^20 tokens (kvsp.MaxGenerateTokens, the
// most a context holds) is 11.5 MB as 10-digit generated token ids, or
// 17.6 MB of Block Keys as a prompt in blocks of 4 tokens. The default
// 1 MiB refused the checkpoints of a session past about 100,000 output
// tokens (found by make api-fuzz), which could then not be resumed.
const MaxCheckpointBody = 24 << 20

// KVSPRoutes is the resource table. Role packages mount their handlers
// from it, so authorization stays in one place.
var KVSPRoutes = []KVSPRoute{
	{RoleIndex, "POST", "lookup", anyone, 0},
	{RoleIndex, "PUT", "replicas/{holder}/{key}", []Role{RoleHolder}, 0},
	{RoleIndex, "DELETE", "replicas/{holder}/{key}", []Role{RoleHolder}, -1},
	{RoleHolder, "GET", "blocks/{compat}/{scope}/{key}", anyone, -1},
	{RoleHolder, "PUT", "blocks/{compat}/{scope}/{key}", producers, MaxBlockBody},
	{RoleHolder, "POST", "leases", anyone, 0},
	{RoleHolder, "PUT", "leases/{id}", anyone, 0},
	{RoleHolder, "DELETE", "leases/{id}", anyone, -1},
	{RoleController, "PUT", "instances/{instance}/status", []Role{RoleInstance}, 0},
	{RoleController, "PUT", "sessions/{session}/checkpoint", []Role{RoleInstance}, MaxCheckpointBody},
	{RoleInstance, "POST", "prefetch", []Role{RoleController}, 0},
	{RoleInstance, "GET", "prefetch/{id}", []Role{RoleController}, -1},
	{RoleInstance, "POST", "sessions/{session}/resume", []Role{RoleController}, MaxCheckpointBody},
	{RoleInstance, "POST", "reshard", []Role{RoleController}, 0},
	{RoleInstance, "PUT", "state", []Role{RoleController}, 0},
}

// RoutesOf returns the rows under a role's base URI.
func RoutesOf(role Role) []KVSPRoute {
	var out []KVSPRoute
	for _, r := range KVSPRoutes {
		if r.Role == role {
			out = append(out, r)
		}
	}
	return out
}

// MountRole adds the handlers of one role's rows of the resource table
// under r, keyed "METHOD path" as in KVSPRoutes. Every row must have a
// handler and every handler a row: the table stays the one place that
// says who may call what.
func MountRole(r *Router, role Role, handlers map[string]HandlerFunc) error {
	rows := RoutesOf(role)
	if len(rows) != len(handlers) {
		return fmt.Errorf("server: %s has %d routes and %d handlers", role, len(rows), len(handlers))
	}
	for _, rt := range rows {
		h, ok := handlers[rt.Method+" "+rt.Path]
		if !ok {
			return fmt.Errorf("server: no handler for %s %s", rt.Method, rt.Path)
		}
		r.Handle(rt.Method, rt.Path, rt.Route(), h)
	}
	return nil
}
