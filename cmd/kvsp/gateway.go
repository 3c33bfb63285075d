package main

import (
	"cmp"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp/engine/llamacpp"
	"github.com/kvsp/kvsp/gateway"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/mtls"
	"github.com/kvsp/kvsp/server"
)

// startGateway serves the OpenAI-compatible API the configuration's
// gateway section names, on its own listener with the process's
// certificate (client certificates optional: API keys authenticate);
// stop shuts it down.
func startGateway(cfg *config.Config, creds *mtls.Credentials, policy *server.PolicyStore, log *slog.Logger, reg prometheus.Registerer) (stop func(), err error) {
	x := cfg.Gateway
	var closers []func()
	defer func() {
		if err != nil {
			for _, c := range closers {
				c()
			}
		}
	}()
	lib := cmp.Or(x.Library, llamacpp.DefaultLibraryDir())
	var models []gateway.Model
	for i, m := range x.Models {
		v, err := llamacpp.OpenVocabulary(m.Model, lib, llamacpp.DescribeOptions{BlockTokens: m.BlockTokens})
		if err != nil {
			return nil, fmt.Errorf("gateway.models[%d]: %w", i, err)
		}
		closers = append(closers, v.Close)
		models = append(models, gateway.Model{ID: m.ID, Vocab: v, ContextTokens: m.ContextTokens, DefaultMaxTokens: m.DefaultMaxTokens, MaxTokens: m.MaxTokens})
	}
	c, err := processClient(cfg, log)
	if err != nil {
		return nil, err
	}
	closers = append(closers, c.Close)
	g, err := gateway.New(gateway.Config{Models: models, Client: c, Controllers: append([]string{x.Controller}, x.Controllers...), Policy: policy,
		Logger: log.With("role", "gateway"), Registerer: reg, KeepAlive: time.Duration(x.KeepAliveMs) * time.Millisecond, MaxBody: int64(x.MaxBody)})
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", x.Listen)
	if err != nil {
		return nil, fmt.Errorf("gateway.listen: %w", err)
	}
	hs := &http.Server{Handler: g, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"},
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return creds.Certificate(), nil },
			ClientAuth:     tls.VerifyClientCertIfGiven, ClientCAs: creds.Roots()}}
	go hs.ServeTLS(ln, "", "")
	log.Info("gateway serving", "url", "https://"+ln.Addr().String()+"/v1", "models", len(models))
	return func() {
		hs.Close()
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}, nil
}
