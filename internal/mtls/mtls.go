// Package mtls holds the mutual-TLS machinery every KVSP process shares:
// reloadable credentials, the server and client TLS configurations, chain
// verification on every handshake including resumptions, and the identity
// of a certificate (decision A-5).
package mtls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// TLSFiles names the PEM files of a process (configuration "tls").
type TLSFiles struct {
	Cert, Key string // this process's certificate (server and, by default, client)
	ClientCA  string // the CA bundle that client certificates must chain to
}

// Credentials holds a certificate and CA bundle read from files, re-read
// when the files change (checked at most once per ReloadInterval, on use),
// so operators rotate them under load without a restart. A failed reload
// keeps the previous credentials and is logged.
type Credentials struct {
	files TLSFiles
	log   *slog.Logger

	mu      sync.Mutex
	checked time.Time
	stamps  [3]fileStamp
	cert    *tls.Certificate
	pool    *x509.CertPool
}

// ReloadInterval bounds how often certificate files are checked.
var ReloadInterval = time.Second

// LoadCredentials reads the files; errors name them.
func LoadCredentials(f TLSFiles, log *slog.Logger) (*Credentials, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Credentials{files: f, log: log}
	if err := c.load(); err != nil {
		return nil, err
	}
	c.checked = time.Now()
	return c, nil
}

type fileStamp struct {
	mod  time.Time
	size int64
}

func stampOf(path string) fileStamp {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}
	}
	return fileStamp{fi.ModTime(), fi.Size()}
}

func (c *Credentials) load() error {
	// Stamp before reading: a file replaced while it is being read then
	// looks changed at the next check instead of already loaded, so a
	// rotation racing a reload is not missed until the one after it.
	stamps := [3]fileStamp{stampOf(c.files.Cert), stampOf(c.files.Key), stampOf(c.files.ClientCA)}
	cert, err := tls.LoadX509KeyPair(c.files.Cert, c.files.Key)
	if err != nil {
		return fmt.Errorf("tls.cert/tls.key: %w", err)
	}
	var pool *x509.CertPool
	if c.files.ClientCA != "" {
		pem, err := os.ReadFile(c.files.ClientCA)
		if err != nil {
			return fmt.Errorf("tls.client_ca: %w", err)
		}
		pool = x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("tls.client_ca: %s holds no PEM certificate", c.files.ClientCA)
		}
	}
	c.cert, c.pool = &cert, pool
	c.stamps = stamps
	return nil
}

// current returns the credentials, reloading them if a file changed.
func (c *Credentials) current() (*tls.Certificate, *x509.CertPool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := time.Now(); now.Sub(c.checked) >= ReloadInterval {
		c.checked = now
		st := [3]fileStamp{stampOf(c.files.Cert), stampOf(c.files.Key), stampOf(c.files.ClientCA)}
		if st != c.stamps {
			old, oldPool := c.cert, c.pool
			if err := c.load(); err != nil {
				c.cert, c.pool = old, oldPool
				c.stamps = st // retry only after the next change
				c.log.Error("certificate reload failed; keeping the previous credentials", "err", err)
			} else {
				c.log.Info("certificates reloaded")
			}
		}
	}
	return c.cert, c.pool
}

// Certificate returns the current certificate.
func (c *Credentials) Certificate() *tls.Certificate { cert, _ := c.current(); return cert }

// Roots returns the current CA pool.
func (c *Credentials) Roots() *x509.CertPool { _, p := c.current(); return p }

// ServerTLSConfig returns the TLS configuration of every KVSP listener
// (R-HTTP-4, R-HTTP-5, A-32): TLS 1.3 only, a client certificate required,
// HTTP/2 preferred over HTTP/1.1 by ALPN.
//
// The chain is verified in VerifyConnection against the CA bundle current
// at that handshake, and the identity rules applied there. VerifyConnection
// runs on every handshake including resumptions, so a session ticket
// issued before a CA rotation or after expiry does not get back in (the
// resumption path of crypto/tls does not re-run certificate verification on
// its own: golang/go issues 77217 and 77377). Whether the identity is still
// authorized is decided per request against the current policy.
func ServerTLSConfig(c *Credentials) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2", "http/1.1"},
		ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return c.Certificate(), nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := VerifyClientChain(cs.PeerCertificates, c.Roots(), time.Now())
			return err
		},
	}
}

// VerifyClientChain verifies a client's certificate chain against roots at
// time now for client authentication, and returns its identity.
func VerifyClientChain(certs []*x509.Certificate, roots *x509.CertPool, now time.Time) (string, error) {
	if len(certs) == 0 {
		return "", errors.New("mtls: no client certificate")
	}
	if roots == nil {
		return "", errors.New("mtls: no client CA configured")
	}
	// crypto/x509 checks extended key usage only. A key usage extension
	// that does not allow digitalSignature forbids the key to sign the
	// handshake (RFC 5280 section 4.2.1.3; RELIABILITY.md row S1).
	if ku := certs[0].KeyUsage; ku != 0 && ku&x509.KeyUsageDigitalSignature == 0 {
		return "", errors.New("mtls: client certificate: key usage does not permit digitalSignature")
	}
	inter := x509.NewCertPool()
	for _, ic := range certs[1:] {
		inter.AddCert(ic)
	}
	if _, err := certs[0].Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}); err != nil {
		return "", fmt.Errorf("mtls: client certificate: %w", err)
	}
	return Identity(certs[0])
}

// ClientTLSConfig returns the TLS configuration a process uses to call
// other roles: TLS 1.3, its own certificate (reloaded on change through
// GetClientCertificate), servers verified against the CA bundle.
func ClientTLSConfig(c *Credentials) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2", "http/1.1"},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return c.Certificate(), nil
		},
		// Server certificates are checked against the current bundle too.
		InsecureSkipVerify: true, // replaced by VerifyConnection below, which uses the reloadable pool
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("mtls: peer sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, ic := range cs.PeerCertificates[1:] {
				inter.AddCert(ic)
			}
			_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{
				Roots:         c.Roots(),
				Intermediates: inter,
				DNSName:       cs.ServerName,
				KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			})
			return err
		},
	}
}
