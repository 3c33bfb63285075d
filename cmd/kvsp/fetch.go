package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/client"
	"github.com/kvsp/kvsp/container"
	"github.com/kvsp/kvsp/internal/mtls"
)

// cmdFetch GETs one block with the Go client over mutual TLS (TLS 1.3,
// the holder's identity checked), verifies each layer as it arrives and
// the container against Repr-Digest (R-BLK-8), and writes the container.
// A layer that fails its digest is never written: the output is only
// complete, verified containers (written to a file once verified).
func cmdFetch(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("fetch", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	cert := fl.String("cert", "", "the client's certificate (PEM)")
	key := fl.String("key", "", "the client's private key (PEM)")
	ca := fl.String("ca", "", "the CA bundle the holder's certificate must chain to")
	identity := fl.String("server-identity", "", "the identity the holder's certificate must name (A-5: its URI SAN); default: its host name is checked")
	descPath := fl.String("descriptor", "", "the block's model descriptor (its geometry)")
	layers := fl.String("layers", "", "an inclusive layer range a-b (default: the whole block)")
	out := fl.String("o", "", "the output file (default: standard output)")
	timeout := fl.Duration("timeout", 30*time.Second, "the whole transfer's limit")
	if err := fl.Parse(args); err != nil || *cert == "" || *key == "" || *ca == "" || *descPath == "" || fl.NArg() != 1 {
		return usageError("fetch takes --cert FILE --key FILE --ca FILE --descriptor FILE [--server-identity URI] [--layers a-b] [-o FILE] BLOCK-URL")
	}
	base, ref, err := parseBlockURL(fl.Arg(0))
	if err != nil {
		return usageError("%v", err)
	}
	var lr *kvsp.LayerRange
	if *layers != "" {
		a, b, ok := strings.Cut(*layers, "-")
		lo, err1 := strconv.ParseUint(a, 10, 32)
		hi, err2 := strconv.ParseUint(b, 10, 32)
		if !ok || err1 != nil || err2 != nil || lo > hi {
			return usageError("--layers %q: want a-b with a <= b", *layers)
		}
		lr = &kvsp.LayerRange{uint32(lo), uint32(hi)}
	}
	d, err := loadDescriptor(*descPath)
	if err != nil {
		return fmt.Errorf("descriptor: %w", err)
	}
	g, err := geometryOf(d)
	if err != nil {
		return err
	}
	creds, err := mtls.LoadCredentials(mtls.TLSFiles{Cert: *cert, Key: *key, ClientCA: *ca}, nil)
	if err != nil {
		return err
	}
	tc := mtls.ClientTLSConfig(creds)
	if *identity != "" { // the chain, then the identity it authenticates; not the host name
		verify := tc.VerifyConnection
		tc.VerifyConnection = func(cs tls.ConnectionState) error {
			cs.ServerName = ""
			if err := verify(cs); err != nil {
				return err
			}
			if id, err := mtls.Identity(cs.PeerCertificates[0]); err != nil || id != *identity {
				return fmt.Errorf("kvsp fetch: the holder's certificate does not name %s", *identity)
			}
			return nil
		}
	}
	c, err := client.New(client.Config{TLS: tc})
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	s, err := c.Holder(base).GetBlock(ctx, ref, g, client.GetOptions{Layers: lr})
	if err != nil {
		return err
	}
	defer s.Close()
	hdr, err := s.Reader.Header()
	if err != nil {
		return err
	}
	var buf bytes.Buffer // a block is bounded by its geometry (R-BLK-3)
	w := container.NewWriter(&buf, *hdr)
	for {
		l, err := s.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err // a layer or the container failed its digest: nothing is written
		}
		if err := w.WriteLayer(l.K, l.V); err != nil {
			return err
		}
	}
	if _, err := w.Close(); err != nil {
		return err
	}
	if *out == "" {
		_, err := buf.WriteTo(stdout)
		return err
	}
	return os.WriteFile(*out, buf.Bytes(), 0o644)
}

// parseBlockURL splits https://HOST/BASE/blocks/{compat}/{scope}/{key}
// into the holder's base and the block.
func parseBlockURL(u string) (string, client.BlockRef, error) {
	bad := fmt.Errorf("%q: want https://HOST/BASE/blocks/COMPAT/SCOPE/KEY", u)
	i := strings.LastIndex(u, "/blocks/")
	if !strings.HasPrefix(u, "https://") || i < 0 {
		return "", client.BlockRef{}, bad
	}
	parts := strings.Split(u[i+len("/blocks/"):], "/")
	if len(parts) != 3 {
		return "", client.BlockRef{}, bad
	}
	var ref client.BlockRef
	var err error
	if ref.Compat, err = kvsp.ParseCompatID(parts[0]); err == nil {
		if ref.Scope, err = kvsp.ParseScopeID(parts[1]); err == nil {
			ref.Key, err = kvsp.ParseBlockKey(parts[2])
		}
	}
	return u[:i+1], ref, err
}
