package client_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// TestControllerGroupFailover: a client of a PC group moves on from a
// standby (503 with the standby member) and from a PC it cannot reach,
// and sticks to the one that answered; a leader's own 503 (no capacity)
// is final and is not sent to the others.
func TestControllerGroupFailover(t *testing.T) {
	pki := kvsptest.NewPKI(t)
	var standbyCalls, leaderCalls atomic.Int32
	srv := kvsptest.StartServer(t, pki, kvsptest.Options{}, func(s *server.Server) {
		s.Mount("/standby/").Handle("POST", "place", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			standbyCalls.Add(1)
			return kvsp.NewProblem(kvsp.ErrUnavailable, "a standby").With("standby", true)
		})
		s.Mount("/leader/").Handle("POST", "place", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			if leaderCalls.Add(1) > 1 {
				return kvsp.NewProblem(kvsp.ErrUnavailable, "no capacity")
			}
			return server.WriteJSON(w, http.StatusOK, &kvsp.PlaceResponse{Session: kvsp.NewUUID(), Epoch: 1, Instance: "https://ii/"})
		})
	})
	c, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	q := &kvsp.PlaceRequest{ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1}, Tokens: []uint32{1}, MaxTokens: 1}
	unreachable := "https://127.0.0.1:1/pc/"
	ctl := c.Controller(unreachable, srv.URL("/standby/"), srv.URL("/leader/"))
	if _, err := ctl.Place(context.Background(), q); err != nil {
		t.Fatalf("through an unreachable PC and a standby to the leader: %v", err)
	}
	if standbyCalls.Load() != 1 || leaderCalls.Load() != 1 {
		t.Fatalf("calls: standby %d, leader %d", standbyCalls.Load(), leaderCalls.Load())
	}
	// A PC that accepts connections and then says nothing (a hung host):
	// the request was never written, so the next PC gets it.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan struct{})
	go func() {
		defer close(accepted)
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	defer func() { ln.Close(); <-accepted }()
	quick, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), Attempts: 1, Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer quick.Close()
	leaderCalls.Store(0)
	if _, err := quick.Controller("https://"+ln.Addr().String()+"/pc/", srv.URL("/leader/")).Place(context.Background(), q); err != nil {
		t.Fatalf("past a hung PC: %v", err)
	}
	leaderCalls.Store(1)
	// Sticky: the next call goes to the leader first; its 503 is final.
	if _, err := ctl.Place(context.Background(), q); !errors.Is(err, kvsp.ErrUnavailable) {
		t.Fatalf("the leader's own 503: %v", err)
	}
	if standbyCalls.Load() != 1 || leaderCalls.Load() != 2 {
		t.Fatalf("the leader's 503 was sent on: standby %d, leader %d", standbyCalls.Load(), leaderCalls.Load())
	}
}

// TestQUICConnsSpread: with QUICConns, HTTP/3 requests to one peer go out
// over that many QUIC connections, in turn.
func TestQUICConnsSpread(t *testing.T) {
	pki := kvsptest.NewPKI(t)
	var mu sync.Mutex
	peers := map[string]bool{}
	srv := kvsptest.StartServer(t, pki, kvsptest.Options{HTTP3: true}, func(s *server.Server) {
		s.Mount("/pc/").Handle("POST", "place", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			if r.ProtoMajor != 3 {
				return kvsp.NewProblem(kvsp.ErrInvalid, "not HTTP/3")
			}
			mu.Lock()
			peers[r.RemoteAddr] = true
			mu.Unlock()
			return server.WriteJSON(w, http.StatusOK, &kvsp.PlaceResponse{Session: kvsp.NewUUID(), Epoch: 1, Instance: "https://ii/"})
		})
	})
	c, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), HTTP3: true, QUICConns: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	q := &kvsp.PlaceRequest{ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1}, Tokens: []uint32{1}, MaxTokens: 1}
	for range 6 {
		if _, err := c.Controller(srv.URL("/pc/")).Place(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock() // the race detector sees no ordering through UDP
	n := len(peers)
	mu.Unlock()
	if n != 3 {
		t.Fatalf("requests came over %d QUIC connections, want 3", n)
	}
}

// TestPromptSentAsLE32: Place and Generate send the prompt as
// tokens_le32 (kvsp.TokensLE32: a third of the CPU of the decimal array
// at each end), which the server decodes to the caller's tokens; the
// caller's request is not changed.
func TestPromptSentAsLE32(t *testing.T) {
	pki := kvsptest.NewPKI(t)
	ts := []uint32{3, 1, 4, 1, 5, 9, 2, 6, 4294967295}
	check := func(r *http.Request, v kvsp.Validator, tokens *[]uint32) error {
		raw, err := io.ReadAll(r.Body)
		if err != nil {
			return err
		}
		if !bytes.Contains(raw, []byte(`"tokens_le32":`)) || bytes.Contains(raw, []byte(`"tokens":`)) {
			t.Errorf("%s body: %s, want the prompt as tokens_le32 only", r.URL.Path, raw)
		}
		if err := kvsp.Decode(raw, v); err != nil {
			return err
		}
		if !slices.Equal(*tokens, ts) {
			t.Errorf("%s: decoded %v, sent %v", r.URL.Path, *tokens, ts)
		}
		return nil
	}
	srv := kvsptest.StartServer(t, pki, kvsptest.Options{}, func(s *server.Server) {
		s.Mount("/pc/").Handle("POST", "place", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			var q kvsp.PlaceRequest
			if err := check(r, &q, &q.Tokens); err != nil {
				return err
			}
			return server.WriteJSON(w, http.StatusOK, &kvsp.PlaceResponse{Session: kvsp.NewUUID(), Epoch: 1, Instance: "https://ii/"})
		})
		s.Mount("/ii/").Handle("POST", "generate", server.Route{}, func(w http.ResponseWriter, r *http.Request) error {
			var q kvsp.GenerateRequest
			if err := check(r, &q, &q.Tokens); err != nil {
				return err
			}
			w.Header().Set("Content-Type", kvsp.MediaTypeTokens)
			_, err := w.Write([]byte(`{"index":0,"epoch":1,"token":0,"done":true}` + "\n"))
			return err
		})
	})
	c, err := client.New(client.Config{TLS: pki.ClientTLS(pki.Leaf(kvsptest.ClientA)), Attempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	q := &kvsp.PlaceRequest{ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1}, Tokens: ts, MaxTokens: 1}
	if _, err := c.Controller(srv.URL("/pc/")).Place(context.Background(), q); err != nil {
		t.Fatal(err)
	}
	g := &kvsp.GenerateRequest{Session: kvsp.NewUUID(), Epoch: 1, ScopeID: kvsp.ScopeID{1}, CompatID: kvsp.CompatID{1}, Tokens: ts, MaxTokens: 1}
	if err := c.Instance(srv.URL("/ii/")).Generate(context.Background(), g, func(kvsp.GeneratedToken) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if q.TokensLE32 != nil || g.TokensLE32 != nil || !slices.Equal(q.Tokens, ts) || !slices.Equal(g.Tokens, ts) {
		t.Fatal("the caller's request was changed")
	}
}
