package kvsp

import (
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// MaxBaseURILen bounds base URIs in records and configuration.
const MaxBaseURILen = 2048

// NormalizeBaseURI returns the normalised form of a role's base URI (section
// "HTTP Usage", decision A-6): an absolute https URI (or moqt, for a replica
// served through MOQT) ending in "/", with no user information, query or
// fragment; scheme and host in lowercase; the default port 443 dropped;
// percent-encodings in uppercase hex, with unreserved characters decoded;
// dot segments removed (RFC 3986 sections 6.2.2 and 6.2.3).
//
// Producers emit this form, and records are validated against it, so that
// {holder-id}, links[].holder and replica holders join by exact string
//
func NormalizeBaseURI(raw string) (string, error) {
	if len(raw) > MaxBaseURILen {
		return "", invalidf("base URI: longer than %d octets", MaxBaseURILen)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", invalidf("base URI: not a URI")
	}
	scheme := strings.ToLower(u.Scheme)
	switch {
	case scheme != "https" && scheme != "moqt":
		return "", invalidf("base URI: scheme must be https")
	case u.Opaque != "":
		return "", invalidf("base URI: must be hierarchical")
	case u.User != nil:
		return "", invalidf("base URI: must not carry user information")
	case u.RawQuery != "" || u.ForceQuery:
		return "", invalidf("base URI: must not have a query")
	case u.Fragment != "" || strings.Contains(raw, "#"):
		return "", invalidf("base URI: must not have a fragment")
	}
	host := u.Hostname()
	if host == "" {
		return "", invalidf("base URI: host required")
	}
	for i := 0; i < len(host); i++ {
		if host[i] >= 0x80 {
			return "", invalidf("base URI: host must be ASCII (use the A-label form)")
		}
	}
	if strings.Contains(host, "%") {
		return "", invalidf("base URI: IPv6 zone identifiers are not allowed")
	}
	host = strings.ToLower(host)
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	port := u.Port()
	if port != "" {
		n, err := strconv.ParseUint(port, 10, 16)
		if err != nil {
			return "", invalidf("base URI: bad port")
		}
		port = strconv.FormatUint(n, 10) // "0443" is 443
	}
	if port == "443" && scheme == "https" {
		port = ""
	}
	if strings.HasSuffix(u.Host, ":") {
		port = "" // an empty port is the default (RFC 3986 section 6.2.3)
	}
	p, err := normalizePercent(u.EscapedPath())
	if err != nil {
		return "", err
	}
	p = removeDotSegments(p)
	if !strings.HasSuffix(p, "/") {
		return "", invalidf("base URI: path must end in \"/\"")
	}
	var b strings.Builder
	b.WriteString(scheme)
	b.WriteString("://")
	b.WriteString(host)
	if port != "" {
		b.WriteByte(':')
		b.WriteString(port)
	}
	b.WriteString(p)
	return b.String(), nil
}

// ValidateBaseURI reports an error unless s is an https base URI in
// normalised form, as a record member naming a role must be.
func ValidateBaseURI(name, s string) error {
	if err := validateNormalized(name, s); err != nil {
		return err
	}
	if !hasScheme(s, "https") {
		return invalidf("%s: must be an https base URI", name)
	}
	return nil
}

// validateNormalized accepts https and moqt URIs in normalised form; only
// a replica served through MOQT names a moqt holder (R-REC-12).
func validateNormalized(name, s string) error {
	n, err := NormalizeBaseURI(s)
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	if n != s {
		return invalidf("%s: base URI is not in normalised form", name)
	}
	return nil
}

// ResourceID returns the {holder-id} or {instance-id} of a base URI: the
// base64url encoding without padding of the SHA-256 of its octets (section
// "HTTP Usage", R-HTTP-22). Pass the normalised form.
func ResourceID(baseURI string) string {
	sum := sha256.Sum256([]byte(baseURI))
	return base64.RawURLEncoding.EncodeToString(sum[:])
}

func isUnreserved(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

func unhexAny(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// normalizePercent decodes percent-encoded unreserved characters and
// uppercases the hex of the others (RFC 3986 section 6.2.2.1, 6.2.2.2).
func normalizePercent(p string) (string, error) {
	if !strings.Contains(p, "%") {
		return p, nil
	}
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		if p[i] != '%' {
			b.WriteByte(p[i])
			continue
		}
		if i+2 >= len(p) {
			return "", invalidf("base URI: truncated percent-encoding")
		}
		hi, ok1 := unhexAny(p[i+1])
		lo, ok2 := unhexAny(p[i+2])
		if !ok1 || !ok2 {
			return "", invalidf("base URI: bad percent-encoding")
		}
		c := hi<<4 | lo
		if isUnreserved(c) {
			b.WriteByte(c)
		} else {
			b.WriteByte('%')
			b.WriteByte("0123456789ABCDEF"[hi])
			b.WriteByte("0123456789ABCDEF"[lo])
		}
		i += 2
	}
	return b.String(), nil
}

// removeDotSegments is RFC 3986 section 5.2.4 for an absolute path; an empty
// path becomes "/".
func removeDotSegments(in string) string {
	if in == "" {
		return "/"
	}
	var out []string // output segments, each starting with "/"
	for len(in) > 0 {
		switch {
		case strings.HasPrefix(in, "../"):
			in = in[3:]
		case strings.HasPrefix(in, "./"):
			in = in[2:]
		case strings.HasPrefix(in, "/./"):
			in = in[2:]
		case in == "/.":
			in = "/"
		case strings.HasPrefix(in, "/../"):
			in = in[3:]
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
		case in == "/..":
			in = "/"
			if len(out) > 0 {
				out = out[:len(out)-1]
			}
		case in == "." || in == "..":
			in = ""
		default:
			j := strings.IndexByte(in[1:], '/')
			if j < 0 {
				out = append(out, in)
				in = ""
			} else {
				out = append(out, in[:j+1])
				in = in[j+1:]
			}
		}
	}
	s := strings.Join(out, "")
	if s == "" {
		return "/"
	}
	return s
}
