package quicbulk

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

func sampleRequest() *Request {
	return &Request{Method: "PUT", Target: "/h1/blocks/07/6d1c/00?layers=0-3", Header: http.Header{
		"Content-Type":  {"application/kvsp-block"},
		"If-None-Match": {"*"},
		"Repr-Digest":   {"sha-256=:AAAA:"},
	}}
}

// TestHeadRoundTrip: what AppendRequest/AppendResponse encode,
// ReadRequest/ReadResponse give back, and nothing past the head is read.
func TestHeadRoundTrip(t *testing.T) {
	q := sampleRequest()
	b, err := AppendRequest(nil, q)
	if err != nil {
		t.Fatal(err)
	}
	r := bytes.NewReader(append(b, "body"...))
	got, err := ReadRequest(r)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, q) {
		t.Fatalf("got %+v, want %+v", got, q)
	}
	if rest, _ := io.ReadAll(r); string(rest) != "body" {
		t.Fatalf("the head read consumed body octets: %q left", rest)
	}
	s := &Response{Status: 404, Header: http.Header{"Content-Type": {"application/problem+json"}, "Cache-Control": {"no-store"}}}
	b, err = AppendResponse(nil, s)
	if err != nil {
		t.Fatal(err)
	}
	gs, err := ReadResponse(bytes.NewReader(b))
	if err != nil || !reflect.DeepEqual(gs, s) {
		t.Fatalf("got %+v, %v", gs, err)
	}
}

// TestHeadTruncated: every truncation of a head is an error (io.EOF only
// with nothing read), never a shorter head (STYLE rule 2).
func TestHeadTruncated(t *testing.T) {
	b, _ := AppendRequest(nil, sampleRequest())
	for i := range b {
		_, err := ReadRequest(bytes.NewReader(b[:i]))
		switch {
		case i == 0 && err != io.EOF:
			t.Fatalf("empty: %v, want io.EOF", err)
		case i > 0 && err != io.ErrUnexpectedEOF:
			t.Fatalf("%d of %d octets: %v, want io.ErrUnexpectedEOF", i, len(b), err)
		}
		if i > 0 {
			if _, err := ParseRequest(b[1:i]); err == nil && i < len(b) {
				t.Fatalf("ParseRequest took %d of %d octets", i-1, len(b)-1)
			}
		}
	}
}

// TestHeadRefused: heads that are not HTTP are refused at both ends.
func TestHeadRefused(t *testing.T) {
	for name, q := range map[string]*Request{
		"method with space":   {Method: "G T", Target: "/"},
		"absolute target":     {Method: "GET", Target: "https://x/"},
		"scheme-relative":     {Method: "GET", Target: "//x/"},
		"target with space":   {Method: "GET", Target: "/a b"},
		"target with newline": {Method: "GET", Target: "/a\n"},
		"field value CRLF":    {Method: "GET", Target: "/", Header: http.Header{"X": {"a\r\nInjected: 1"}}},
		"field name":          {Method: "GET", Target: "/", Header: http.Header{"X y": {"1"}}},
		"too many fields":     {Method: "GET", Target: "/", Header: http.Header{"X": make([]string, maxFields+1)}},
		"too long":            {Method: "GET", Target: "/" + strings.Repeat("a", MaxHeadLen)},
	} {
		if _, err := AppendRequest(nil, q); !errors.Is(err, errHead) {
			t.Errorf("%s: encoded (%v)", name, err)
		}
	}
	// Hand-made heads the encoder would not write.
	for name, b := range map[string][]byte{
		"over MaxHeadLen":        {0x81, 0x80, 0x01},
		"upper-case field name":  append([]byte{14, 3, 'G', 'E', 'T', 1, '/', 1, 1, 'X', 1, 'v'}, 0, 0),
		"octets after fields":    {6, 3, 'G', 'E', 'T', 1, '/', 0},
		"string past the end":    {5, 9, 'G', 'E', 'T', 1},
		"varint without end":     {4, 0xff, 0xff, 0xff, 0xff},
		"status out of range":    {2, 0x63, 0},
		"header count past data": {5, 3, 'G', 'E', 'T'},
	} {
		_, err1 := ReadRequest(bytes.NewReader(b))
		_, err2 := ReadResponse(bytes.NewReader(b))
		if err1 == nil && err2 == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// FuzzParseRequest: no input panics; whatever parses re-encodes to a head
// that parses the same.
func FuzzParseRequest(f *testing.F) {
	b, _ := AppendRequest(nil, sampleRequest())
	f.Add(b)
	b, _ = AppendResponse(nil, &Response{Status: 200, Header: http.Header{"Content-Length": {"12"}}})
	f.Add(b)
	f.Fuzz(func(t *testing.T, data []byte) {
		if q, err := ReadRequest(bytes.NewReader(data)); err == nil {
			b, err := AppendRequest(nil, q)
			if err != nil {
				t.Fatalf("parsed %+v does not encode: %v", q, err)
			}
			q2, err := ReadRequest(bytes.NewReader(b))
			if err != nil || !reflect.DeepEqual(q, q2) {
				t.Fatalf("%+v re-parsed as %+v, %v", q, q2, err)
			}
		}
		if r, err := ReadResponse(bytes.NewReader(data)); err == nil {
			b, err := AppendResponse(nil, r)
			if err != nil {
				t.Fatalf("parsed %+v does not encode: %v", r, err)
			}
			if r2, err := ReadResponse(bytes.NewReader(b)); err != nil || !reflect.DeepEqual(r, r2) {
				t.Fatalf("%+v re-parsed as %+v, %v", r, r2, err)
			}
		}
	})
}
