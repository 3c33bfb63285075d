package mtls

import (
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
)

// ErrIdentity is the failure to take an identity from a certificate.
var ErrIdentity = errors.New("mtls: no usable identity in the client certificate")

// Identity returns the identity a certificate authenticates (decision A-5):
// its URI SAN when it has exactly one (SPIFFE style), else its DNS SAN when
// it has exactly one and no URI SAN. Anything else is ambiguous and fails
// closed. A DNS SAN must be a host name (RFC 1123 letters, digits,
// hyphens and dots): one that is not, "spiffe://..." say, would otherwise
// be taken for the URI identity it spells, which only a URI SAN may carry.
func Identity(c *x509.Certificate) (string, error) {
	switch {
	case c == nil:
		return "", ErrIdentity
	case len(c.URIs) == 1:
		return c.URIs[0].String(), nil
	case len(c.URIs) > 1:
		return "", fmt.Errorf("%w: %d URI SANs", ErrIdentity, len(c.URIs))
	case len(c.DNSNames) == 1:
		if !isHostName(c.DNSNames[0]) {
			return "", fmt.Errorf("%w: the DNS SAN is not a DNS name", ErrIdentity)
		}
		return c.DNSNames[0], nil
	case len(c.DNSNames) > 1:
		return "", fmt.Errorf("%w: %d DNS SANs and no URI SAN", ErrIdentity, len(c.DNSNames))
	}
	return "", fmt.Errorf("%w: no URI or DNS SAN", ErrIdentity)
}

// isHostName reports a DNS host name: dot-separated labels of 1 to 63
// letters, digits and hyphens, not starting or ending with a hyphen, 253
// octets at most.
func isHostName(s string) bool {
	if s == "" || len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}
