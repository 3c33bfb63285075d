package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/server"
)

// cmdServe runs `kvsp serve --config FILE` until SIGTERM or SIGINT.
func cmdServe(args []string, stdout, stderr io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	return serve(ctx, args, stderr, hup, nil)
}

// serve is cmdServe with its context and signals injectable; ready, if
// set, receives the listening address.
func serve(ctx context.Context, args []string, stderr io.Writer, hup <-chan os.Signal, ready chan<- string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	path := fs.String("config", "", "configuration file")
	if err := fs.Parse(args); err != nil || *path == "" || fs.NArg() != 0 {
		return usageError("serve takes --config FILE")
	}
	log := slog.New(slog.NewJSONHandler(stderr, nil))
	cfg, err := config.Load(*path)
	if err != nil {
		return err // before anything listens
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.Cert, Key: cfg.TLS.Key, ClientCA: cfg.TLS.ClientCA}, log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	if _, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: cfg.TLS.ClientCert, Key: cfg.TLS.ClientKey, ClientCA: cfg.TLS.ClientCA}, log); err != nil {
		return fmt.Errorf("config: tls.client_cert/client_key: %w", err)
	}
	policy, err := server.LoadPolicyStore(cfg.Policy, log)
	if err != nil {
		return fmt.Errorf("config: %w", err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	srv, err := server.New(server.Config{Credentials: creds, Policy: policy, HTTP3: cfg.HTTP3, Logger: log, Registerer: reg})
	if err != nil {
		return err
	}
	mountRoles(srv, cfg, log)

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	var metrics *http.Server
	if cfg.MetricsListen != "" {
		mln, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			ln.Close()
			return fmt.Errorf("metrics_listen: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		metrics = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go metrics.Serve(mln)
	}
	wctx, cancelWatch := context.WithCancel(ctx)
	defer cancelWatch()
	go policy.Watch(wctx, 2*time.Second)
	go func() {
		for {
			select {
			case <-wctx.Done():
				return
			case <-hup:
				if err := policy.Reload(); err != nil {
					log.Error("SIGHUP: policy reload failed; the previous policy stays in force", "err", err)
				} else {
					log.Info("SIGHUP: policy reloaded")
				}
			}
		}
	}()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	log.Info("serving", "listen", ln.Addr().String(), "roles", cfg.Roles(), "http3", cfg.HTTP3)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if metrics != nil {
		metrics.Shutdown(sctx)
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		err = errors.Join(err, serr)
	}
	return err
}

// mountRoles mounts the base path of every role the configuration names.
// Their handlers arrive with their issues (index, holder, placement,
// instance); until then each base answers 404 problems behind the full
// authentication and authorization stack.
func mountRoles(srv *server.Server, cfg *config.Config, log *slog.Logger) {
	var bases []string
	if cfg.Index != nil {
		bases = append(bases, cfg.Index.Base)
	}
	if cfg.Controller != nil {
		bases = append(bases, cfg.Controller.Base)
	}
	bases = append(bases, cfg.SpeaksFor()...)
	for _, b := range bases {
		log.Info("role mounted (no handlers yet)", "base", b)
	}
}
