package quicbulk

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// ALPN is the application protocol of the bulk path.
const ALPN = "kvsp-bulk/1"

// MaxHeadLen bounds a head (request or response), in octets.
const MaxHeadLen = 16 << 10

// maxFields bounds the fields of a head.
const maxFields = 64

// Stream error codes (QUIC RESET_STREAM / STOP_SENDING).
const (
	// CodeCancelled: the side that sends it no longer wants the stream.
	CodeCancelled = 0x10c
	// CodeAborted: the response failed after it started; its body is cut.
	CodeAborted = 0x10d
	// CodeBadHead: the request head was not well formed.
	CodeBadHead = 0x10e
	// CodeShutdown: the server is shutting down; retry elsewhere.
	CodeShutdown = 0x10f
)

// errHead is the error of every malformed head.
var errHead = errors.New("quicbulk: malformed head")

// Request is a request head.
type Request struct {
	Method string
	Target string // origin form: "/holder/blocks/...?layers=0-3"
	Header http.Header
}

// Response is a response head.
type Response struct {
	Status int
	Header http.Header
}

// AppendRequest appends the encoded head of r to b.
func AppendRequest(b []byte, r *Request) ([]byte, error) {
	if !isToken(r.Method) {
		return b, fmt.Errorf("%w: method %q", errHead, r.Method)
	}
	if !validTarget(r.Target) {
		return b, fmt.Errorf("%w: target must be a path and query", errHead)
	}
	body := appendString(appendString(nil, r.Method), r.Target)
	body, err := appendFields(body, r.Header)
	if err != nil {
		return b, err
	}
	return appendHead(b, body)
}

// AppendResponse appends the encoded head of r to b.
func AppendResponse(b []byte, r *Response) ([]byte, error) {
	if r.Status < 100 || r.Status > 599 {
		return b, fmt.Errorf("%w: status %d", errHead, r.Status)
	}
	body, err := appendFields(binary.AppendUvarint(nil, uint64(r.Status)), r.Header)
	if err != nil {
		return b, err
	}
	return appendHead(b, body)
}

func appendHead(b, body []byte) ([]byte, error) {
	if len(body) > MaxHeadLen {
		return b, fmt.Errorf("%w: over %d octets", errHead, MaxHeadLen)
	}
	return append(binary.AppendUvarint(b, uint64(len(body))), body...), nil
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

func appendFields(b []byte, h http.Header) ([]byte, error) {
	n := 0
	for _, vs := range h {
		n += len(vs)
	}
	if n > maxFields {
		return b, fmt.Errorf("%w: over %d fields", errHead, maxFields)
	}
	b = binary.AppendUvarint(b, uint64(n))
	for k, vs := range h {
		name := strings.ToLower(k)
		if !isToken(name) {
			return b, fmt.Errorf("%w: field name %q", errHead, k)
		}
		for _, v := range vs {
			if !validValue(v) {
				return b, fmt.Errorf("%w: value of %s", errHead, name)
			}
			b = appendString(appendString(b, name), v)
		}
	}
	return b, nil
}

// ReadRequest reads a request head from r (one octet at a time up to the
// length, so nothing of the body is consumed).
func ReadRequest(r io.Reader) (*Request, error) {
	body, err := readHead(r)
	if err != nil {
		return nil, err
	}
	return ParseRequest(body)
}

// ReadResponse reads a response head from r.
func ReadResponse(r io.Reader) (*Response, error) {
	body, err := readHead(r)
	if err != nil {
		return nil, err
	}
	return ParseResponse(body)
}

func readHead(r io.Reader) ([]byte, error) {
	var one [1]byte
	var n uint64
	for i := 0; ; i++ {
		if i == binary.MaxVarintLen16+1 { // MaxHeadLen fits in 3 octets
			return nil, fmt.Errorf("%w: length", errHead)
		}
		if _, err := io.ReadFull(r, one[:]); err != nil {
			if i > 0 && err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		n |= uint64(one[0]&0x7f) << (7 * i)
		if one[0] < 0x80 {
			break
		}
	}
	if n > MaxHeadLen {
		return nil, fmt.Errorf("%w: %d octets, over %d", errHead, n, MaxHeadLen)
	}
	body := make([]byte, n)
	if _, err := io.ReadFull(r, body); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	return body, nil
}

// ParseRequest parses the octets of a request head after its length.
func ParseRequest(b []byte) (*Request, error) {
	p := parser{b: b}
	r := &Request{Method: p.string(), Target: p.string()}
	r.Header = p.fields()
	if p.err != nil {
		return nil, p.err
	}
	if !isToken(r.Method) || !validTarget(r.Target) {
		return nil, fmt.Errorf("%w: request line", errHead)
	}
	return r, nil
}

// ParseResponse parses the octets of a response head after its length.
func ParseResponse(b []byte) (*Response, error) {
	p := parser{b: b}
	status := p.uvarint()
	r := &Response{Header: p.fields()}
	if p.err != nil {
		return nil, p.err
	}
	if status < 100 || status > 599 {
		return nil, fmt.Errorf("%w: status %d", errHead, status)
	}
	r.Status = int(status)
	return r, nil
}

type parser struct {
	b   []byte
	err error
}

func (p *parser) fail(what string) {
	if p.err == nil {
		p.err = fmt.Errorf("%w: %s", errHead, what)
	}
	p.b = nil
}

func (p *parser) uvarint() uint64 {
	v, n := binary.Uvarint(p.b)
	if n <= 0 {
		p.fail("varint")
		return 0
	}
	p.b = p.b[n:]
	return v
}

func (p *parser) string() string {
	n := p.uvarint()
	if n > uint64(len(p.b)) {
		p.fail("string past the end")
		return ""
	}
	s := string(p.b[:n])
	p.b = p.b[n:]
	return s
}

func (p *parser) fields() http.Header {
	n := p.uvarint()
	if n > maxFields {
		p.fail("too many fields")
		return nil
	}
	h := make(http.Header, n)
	for range n {
		k, v := p.string(), p.string()
		if p.err != nil {
			return nil
		}
		if !isToken(k) || k != strings.ToLower(k) || !validValue(v) {
			p.fail("field")
			return nil
		}
		ck := http.CanonicalHeaderKey(k)
		h[ck] = append(h[ck], v)
	}
	if len(p.b) != 0 {
		p.fail("octets after the fields")
	}
	return h
}

// isToken reports an RFC 9110 token (method, field name).
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0 {
			continue
		}
		return false
	}
	return true
}

// validValue reports an RFC 9110 field value: no CR, LF or NUL, no
// leading or trailing whitespace.
func validValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '\r' || c == '\n' || c == 0 || c == 0x7f || (c < 0x20 && c != '\t') {
			return false
		}
	}
	return s == strings.TrimSpace(s)
}

// validTarget reports an origin-form target: "/" then visible ASCII.
func validTarget(s string) bool {
	if !strings.HasPrefix(s, "/") || strings.HasPrefix(s, "//") {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] <= 0x20 || s[i] >= 0x7f || s[i] == '#' {
			return false
		}
	}
	return true
}
