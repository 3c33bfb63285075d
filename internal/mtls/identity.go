package mtls

import (
	"crypto/x509"
	"errors"
	"fmt"
)

// ErrIdentity is the failure to take an identity from a certificate.
var ErrIdentity = errors.New("mtls: no usable identity in the client certificate")

// Identity returns the identity a certificate authenticates (decision A-5):
// its URI SAN when it has exactly one (SPIFFE style), else its DNS SAN when
// it has exactly one and no URI SAN. Anything else is ambiguous and fails
// closed.
func Identity(c *x509.Certificate) (string, error) {
	switch {
	case c == nil:
		return "", ErrIdentity
	case len(c.URIs) == 1:
		return c.URIs[0].String(), nil
	case len(c.URIs) > 1:
		return "", fmt.Errorf("%w: %d URI SANs", ErrIdentity, len(c.URIs))
	case len(c.DNSNames) == 1:
		return c.DNSNames[0], nil
	case len(c.DNSNames) > 1:
		return "", fmt.Errorf("%w: %d DNS SANs and no URI SAN", ErrIdentity, len(c.DNSNames))
	}
	return "", fmt.Errorf("%w: no URI or DNS SAN", ErrIdentity)
}
