package holder

import "io"

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
