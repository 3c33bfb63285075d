package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/controlplane/index"
	"github.com/kvsp/kvsp/controlplane/placement"
	"github.com/kvsp/kvsp/engine/attach"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/rdma"
	"github.com/kvsp/kvsp/server"
)

// closers is a stack of what the roles started: each is closed after
// what was pushed after it (a holder before the client it withdraws its
// records with, a snapshot written before its backend closes).
type closers []func()

func (c *closers) push(f func()) { *c = append(*c, f) }

func (c closers) closeAll() {
	for i := len(c) - 1; i >= 0; i-- {
		c[i]()
	}
}

// mounted is what mountRoles built that serve needs afterwards.
type mounted struct {
	pc *placement.Controller // the placement controller, for the status page
}

// roleEnv is what every role's mounting shares: the server it mounts on,
// the configuration, the log and metrics, the descriptors' sizes, the
// status table a co-located PC feeds the IS with, and the stack
// of closers.
type roleEnv struct {
	srv         *server.Server
	cfg         *config.Config
	log         *slog.Logger
	reg         prometheus.Registerer
	blockTokens map[kvsp.CompatID]int
	layers      map[kvsp.CompatID]int
	statuses    *index.StatusTable
	cs          closers
}

// mountRoles mounts the handlers of every role the configuration names,
// and returns what closes them, in order.
func mountRoles(srv *server.Server, cfg *config.Config, log *slog.Logger, reg prometheus.Registerer, out *mounted) (func(), error) {
	e := &roleEnv{srv: srv, cfg: cfg, log: log, reg: reg, statuses: index.NewStatusTable()}
	var err error
	if e.blockTokens, e.layers, err = descriptorSizes(cfg); err != nil {
		return nil, err
	}
	for _, mount := range []func() error{e.mountIndex, e.mountHolders, func() error { return e.mountController(out) }, e.mountInstances} {
		if err := mount(); err != nil {
			e.cs.closeAll()
			return nil, err
		}
	}
	return e.cs.closeAll, nil
}

// client is the process's client for one role (processClient), closed
// with the role.
func (e *roleEnv) client() (*client.Client, error) {
	c, err := processClient(e.cfg, e.log)
	if err != nil {
		return nil, err
	}
	e.cs.push(c.Close)
	return c, nil
}

// scopeKeys are the configuration's scope keys.
func (e *roleEnv) scopeKeys() []kvsp.ScopeKey {
	var keys []kvsp.ScopeKey
	for _, s := range e.cfg.ScopeKeys {
		keys = append(keys, s.Key)
	}
	return keys
}

func (e *roleEnv) mountIndex() error {
	x := e.cfg.Index
	if x == nil {
		return nil
	}
	backend, err := indexBackend(e.cfg)
	if err != nil {
		return err
	}
	e.cs.push(func() { backend.Close() })
	if mem, ok := backend.(*index.Memory); ok && x.Snapshot != "" {
		n, err := mem.LoadSnapshotFile(x.Snapshot)
		if err != nil {
			return fmt.Errorf("index.snapshot: %w", err)
		}
		e.log.Info("index snapshot loaded", "records", n)
		e.cs.push(func() {
			n, err := mem.SaveSnapshotFile(x.Snapshot)
			if err != nil {
				e.log.Error("index snapshot not written", "err", err)
				return
			}
			e.log.Info("index snapshot written", "records", n)
		})
	}
	svc, err := index.New(index.Config{
		MaxTTL:           time.Duration(x.MaxTTLMs) * time.Millisecond,
		MaxLookupKeys:    x.MaxLookupKeys,
		ProducerDigests:  x.ProducerDigests,
		MaxHolderRecords: x.MaxHolderRecords,
		MaxResponseBytes: int(x.MaxResponseBytes),
		Status:           e.statuses, // fed by a co-located PC
		BlockTokens: func(c kvsp.CompatID) (int, bool) {
			b, ok := e.blockTokens[c]
			return b, ok
		},
		Layers: func(c kvsp.CompatID) (int, bool) { // a record lists at most the model's layers (B9)
			n, ok := e.layers[c]
			return n, ok
		},
		Logger:     e.log,
		Registerer: e.reg,
	}, backend)
	if err != nil {
		return err
	}
	if err := svc.Mount(e.srv.Mount(basePath(x.Base))); err != nil {
		return err
	}
	e.log.Info("role mounted", "role", "index", "base", x.Base, "backend", x.Backend)
	return nil
}

func (e *roleEnv) mountHolders() error {
	if len(e.cfg.Holders) == 0 {
		return nil
	}
	hc, err := e.client()
	if err != nil {
		return err
	}
	for i := range e.cfg.Holders {
		if err := e.mountHolder(&e.cfg.Holders[i], hc); err != nil {
			return fmt.Errorf("holders[%d]%w", i, err)
		}
	}
	return nil
}

// mountHolder mounts one holder; its errors start with the member they
// concern (".rdma: ...", ": ..."), after holders[i].
func (e *roleEnv) mountHolder(hcfg *config.Holder, hc *client.Client) error {
	var target *rdma.Target
	if hcfg.RDMA != nil {
		v, err := rdma.OpenVerbs(hcfg.RDMA.Device)
		if err != nil {
			return fmt.Errorf(".rdma: %w", err)
		}
		target = rdma.NewTarget(v)
		e.cs.push(func() { target.Close(); v.Close() })
		e.log.Info("RDMA reads", "base", hcfg.Base, "device", v.Name())
	}
	hreg := prometheus.WrapRegistererWith(prometheus.Labels{"holder": hcfg.Base}, e.reg)
	if target != nil {
		if err := registerTargetMetrics(hreg, target); err != nil {
			return fmt.Errorf(": %w", err)
		}
	}
	h, err := newHolder(e.cfg, hcfg, hc, target, e.log, hreg)
	if err != nil {
		return fmt.Errorf(": %w", err)
	}
	e.cs.push(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		h.Close(ctx) // withdraws its records
	})
	if sock := hcfg.AttachSocket; sock != "" {
		stop, err := serveAttach(sock, h.AttachHandler())
		if err != nil {
			return fmt.Errorf(".attach_socket: %w", err)
		}
		e.cs.push(stop)
		e.log.Info("engines attach here", "socket", sock, "holder", hcfg.Base)
	}
	if err := h.Mount(e.srv.Mount(basePath(hcfg.Base))); err != nil {
		return fmt.Errorf(": %w", err)
	}
	e.log.Info("role mounted", "role", "holder", "base", hcfg.Base)
	return nil
}

func (e *roleEnv) mountController(out *mounted) error {
	x := e.cfg.Controller
	if x == nil {
		return nil
	}
	pcc, err := e.client()
	if err != nil {
		return err
	}
	var (
		state placement.Store
		group *placement.EtcdStore
	)
	switch x.State {
	case "bolt":
		st, err := placement.OpenBoltStore(x.StatePath)
		if err != nil {
			return err
		}
		state = st
		e.cs.push(func() { st.Close() })
	case "etcd":
		ec := placement.EtcdConfig{Endpoints: x.Etcd.Endpoints, Prefix: x.Etcd.Prefix, SessionTTL: time.Duration(x.Etcd.SessionTTLMs) * time.Millisecond}
		if strings.HasPrefix(x.Etcd.Endpoints[0], "https://") {
			creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: e.cfg.TLS.ClientCert, Key: e.cfg.TLS.ClientKey, ClientCA: e.cfg.TLS.ClientCA}, e.log)
			if err != nil {
				return fmt.Errorf("config: tls.client_cert: %w", err)
			}
			ec.TLS = mtls.ClientTLSConfig(creds)
			ec.TLS.NextProtos = []string{"h2"} // gRPC
		}
		st, err := placement.OpenEtcdStore(ec)
		if err != nil {
			return err
		}
		state, group = st, st
		e.cs.push(func() { st.Close() })
	}
	pc, err := placement.New(placement.Config{Scopes: e.scopeKeys(), BlockTokens: e.blockTokens, Index: pcc.Index(x.Index),
		Instances: placement.ClientInstances{C: pcc}, OnStatus: e.statuses.Update, State: state, Logger: e.log, Registerer: e.reg,
		Self: x.Base, Standby: group != nil, MinDeadline: time.Duration(x.MinDeadlineMs) * time.Millisecond,
		PlacementTTL: time.Duration(x.PlacementTTLMs) * time.Millisecond, MaxShare: x.MaxShare})
	if err != nil {
		return err
	}
	out.pc = pc
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	running.Go(func() { pc.Run(ctx, 250*time.Millisecond) })
	if group != nil {
		running.Go(func() { pc.RunHA(ctx, group, x.Base) })
	}
	e.cs.push(func() { cancel(); running.Wait() })
	if err := pc.Mount(e.srv.Mount(basePath(x.Base))); err != nil {
		return err
	}
	e.log.Info("role mounted", "role", "controller", "base", x.Base)
	return nil
}

func (e *roleEnv) mountInstances() error {
	if len(e.cfg.Instances) == 0 {
		return nil
	}
	ic, err := e.client()
	if err != nil {
		return err
	}
	keys := e.scopeKeys()
	for i := range e.cfg.Instances {
		x := &e.cfg.Instances[i]
		a, stop, err := newInstance(x, ic, keys, e.log, prometheus.WrapRegistererWith(prometheus.Labels{"ii": x.Base}, e.reg))
		if err != nil {
			return fmt.Errorf("instances[%d]: %w", i, err)
		}
		e.cs.push(stop)
		if err := a.Mount(e.srv.Mount(basePath(x.Base))); err != nil {
			return err
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { a.Run(ctx); close(done) }()
		e.cs.push(func() { cancel(); <-done })
		e.log.Info("role mounted", "role", "instance", "base", x.Base, "engine", x.Engine.Kind)
	}
	return nil
}

// serveAttach serves h at the Unix socket sock (a previous run's socket
// removed first, the new one private to the user); stop closes the
// sessions and removes the socket.
func serveAttach(sock string, h attach.Handler) (stop func(), err error) {
	os.Remove(sock)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err == nil {
		if err = os.Chmod(sock, 0o600); err != nil {
			ln.Close()
		}
	}
	if err != nil {
		return nil, err
	}
	as := &attach.Server{Handler: h}
	done := make(chan struct{})
	go func() { as.Serve(ln); close(done) }()
	return func() { as.Close(); <-done; os.Remove(sock) }, nil
}
