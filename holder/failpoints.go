package holder

import (
	"io"

	"github.com/kvsp/kvsp/internal/failpoint"
)

// bitrot is what the failpoint holder/corrupt-on-read (RELIABILITY F1)
// puts between a GET's body and the connection: the octet at offset at of
// the body is sent flipped, from a copy (the stored block is untouched),
// after Repr-Digest was set from the stored digest, as a bit rotting in
// memory or on the wire would.
type bitrot struct {
	w   io.Writer
	at  int64
	off int64
}

func (b *bitrot) Write(p []byte) (int, error) {
	if i := b.at - b.off; i >= 0 && i < int64(len(p)) {
		c := make([]byte, len(p))
		copy(c, p)
		c[i] ^= 0x01
		p = c
	}
	n, err := b.w.Write(p)
	b.off += int64(n)
	return n, err
}

// midway is what the failpoint holder/get-midway (RELIABILITY F3) puts
// between a GET's body and the connection: once half the body is sent,
// the failpoint runs (a sleep, a pause) before the rest is read from the
// block's memory, so that a test can evict the block under a stream that
// has not read all of it.
type midway struct {
	w   io.Writer
	at  int64
	off int64
	hit bool
}

func (m *midway) Write(p []byte) (int, error) {
	if m.hit || m.off+int64(len(p)) <= m.at {
		n, err := m.w.Write(p)
		m.off += int64(n)
		return n, err
	}
	i := max(0, m.at-m.off)
	n, err := m.w.Write(p[:i])
	m.off += int64(n)
	if err != nil {
		return n, err
	}
	m.hit = true
	failpoint.Eval("holder/get-midway")
	k, err := m.w.Write(p[i:])
	m.off += int64(k)
	return n + k, err
}
