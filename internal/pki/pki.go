// Package pki issues the certificates of a KVSP deployment for development
// and tests: a CA, and leaf certificates whose URI SAN is the principal's
// identity (SPIFFE style) and which serve as both TLS server and client
// certificates. Keys are ECDSA P-256. `kvsp certs` and the test harness use
// it; production deployments bring their own CA.
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"time"
)

// CA is a certificate authority with its private key.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
}

// NewCA creates a self-signed CA valid from now for the given duration.
func NewCA(name string, validity time.Duration) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	return n
}

// LeafOptions describe a leaf certificate.
type LeafOptions struct {
	URIs      []string // URI SANs; the identity is the single one
	DNSNames  []string
	IPs       []net.IP
	NotBefore time.Time // zero: now - 1 minute
	NotAfter  time.Time // zero: NotBefore + 1 year
}

// Leaf is an issued certificate and its key.
type Leaf struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
}

// Issue signs a leaf certificate usable for TLS server and client auth.
func (ca *CA) Issue(o LeafOptions) (*Leaf, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	if o.NotBefore.IsZero() {
		o.NotBefore = time.Now().Add(-time.Minute)
	}
	if o.NotAfter.IsZero() {
		o.NotAfter = o.NotBefore.Add(365 * 24 * time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		NotBefore:    o.NotBefore,
		NotAfter:     o.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		DNSNames:     o.DNSNames,
		IPAddresses:  o.IPs,
	}
	if len(o.URIs) > 0 {
		tmpl.Subject.CommonName = o.URIs[0]
	} else if len(o.DNSNames) > 0 {
		tmpl.Subject.CommonName = o.DNSNames[0]
	}
	for _, s := range o.URIs {
		u, err := url.Parse(s)
		if err != nil {
			return nil, fmt.Errorf("pki: URI SAN %q: %w", s, err)
		}
		tmpl.URIs = append(tmpl.URIs, u)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &Leaf{Cert: cert, Key: key}, nil
}

// TLSCertificate returns the leaf as a tls.Certificate.
func (l *Leaf) TLSCertificate() tls.Certificate {
	return tls.Certificate{Certificate: [][]byte{l.Cert.Raw}, PrivateKey: l.Key, Leaf: l.Cert}
}

// CertPEM returns the certificate in PEM.
func CertPEM(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

// KeyPEM returns the private key in PKCS #8 PEM.
func KeyPEM(k *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// Pool returns a pool holding the CA certificate.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// WriteFiles writes the leaf's certificate (0644) and key (0600).
func (l *Leaf) WriteFiles(certPath, keyPath string) error {
	k, err := KeyPEM(l.Key)
	if err != nil {
		return err
	}
	if err := os.WriteFile(certPath, CertPEM(l.Cert), 0o644); err != nil {
		return err
	}
	return os.WriteFile(keyPath, k, 0o600)
}

// WriteFiles writes the CA certificate (0644) and key (0600).
func (ca *CA) WriteFiles(certPath, keyPath string) error {
	return (&Leaf{Cert: ca.Cert, Key: ca.Key}).WriteFiles(certPath, keyPath)
}

// LoadCA reads a CA certificate and key written by WriteFiles.
func LoadCA(certPath, keyPath string) (*CA, error) {
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return nil, err
	}
	key, ok := pair.PrivateKey.(*ecdsa.PrivateKey)
	if !ok {
		return nil, errors.New("pki: CA key is not ECDSA")
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}
