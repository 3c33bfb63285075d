package container

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"sync"
)

// readChunk is how much ReadBlock reads before handing octets to the
// hashers.
const readChunk = 256 << 10

// ReadBlock reads one complete container of exactly n octets from r (a
// block PUT with its Content-Length), validating the header against g as
// soon as it has arrived and hashing the octets while later ones are still
// arriving: the container digest in one goroutine and the layer digests in
// another, so receiving (and decrypting TLS) overlaps with hashing. It
// returns the same Block as OpenBlock on the same octets.
func ReadBlock(r io.Reader, n int64, g Geometry) (*Block, error) {
	return ReadBlockInto(r, n, g, nil)
}

// ReadBlockInto is ReadBlock with the block's memory from alloc (a buffer
// of at least n octets, which the returned Block keeps): holders store
// blocks in recycled memory, since a fresh 2 MiB allocation costs as much
// as hashing it (page faults and zeroing). alloc is called once the header
// has been validated; on error the buffer is the caller's again. A nil
// alloc allocates.
func ReadBlockInto(r io.Reader, n int64, g Geometry, alloc func(n int) []byte) (*Block, error) {
	return ReadBlockWith(r, n, g, ReadOptions{Alloc: alloc})
}

// ReadOptions are ReadBlockWith's hooks.
type ReadOptions struct {
	// Alloc, when set, gives the block's memory (see ReadBlockInto).
	Alloc func(n int) []byte
	// Header, when set, gets the validated header before any layer
	// arrives (a holder reserves device memory for the first layers).
	Header func(h *Header)
	// Layer, when set, gets each layer's octets (K then V) as soon as the
	// layer has arrived and been hashed, in order, from the hashing
	// goroutine: a holder copies it to device memory while the next ones
	// arrive. Nothing is verified yet: the block as a whole is, when
	// ReadBlockWith returns without error.
	Layer func(i int, octets []byte)
}

// ReadBlockWith is ReadBlockInto with hooks.
func ReadBlockWith(r io.Reader, n int64, g Geometry, o ReadOptions) (*Block, error) {
	alloc := o.Alloc
	if n < FixedHeaderLen {
		return nil, truncated("header")
	}
	var fixed [FixedHeaderLen]byte
	if _, err := io.ReadFull(r, fixed[:]); err != nil {
		return nil, readErr(err, "header")
	}
	var h Header
	count, err := parseFixed(fixed[:], g, &h)
	if err != nil {
		return nil, err
	}
	hl := HeaderLen(count)
	if n < int64(hl) {
		return nil, truncated("header")
	}
	h.Layers = make([]LayerLen, count)
	lens := make([]byte, hl-FixedHeaderLen)
	if _, err := io.ReadFull(r, lens); err != nil {
		return nil, readErr(err, "header")
	}
	if err := parseLengths(lens, g, &h); err != nil {
		return nil, err
	}
	if size := h.Size(); uint64(n) != size {
		return nil, fmt.Errorf("%w: %d octets announced, the header makes %d", ErrMalformed, n, size)
	}
	var data []byte
	if alloc != nil {
		data = alloc(int(n))[:n]
	} else {
		data = make([]byte, n)
	}
	copy(data, fixed[:])
	copy(data[FixedHeaderLen:], lens)
	if o.Header != nil {
		o.Header(&h)
	}

	b := &Block{data: data, h: h, hl: hl, offs: make([]uint64, count+1), layers: make([]Digest, count)}
	off := uint64(hl)
	for i, l := range h.Layers {
		b.offs[i] = off
		off += l.K + l.V
	}
	b.offs[count] = off

	// Progress is published to both hashers after every chunk.
	wholeC, layerC := make(chan int, 64), make(chan int, 64)
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the container digest, in arrival order
		defer wg.Done()
		hs := sha256.New()
		done := 0
		for filled := range wholeC {
			hs.Write(data[done:filled])
			done = filled
		}
		hs.Sum(b.whole[:0])
	}()
	go func() { // each layer once it is complete
		defer wg.Done()
		next := 0
		for filled := range layerC {
			for next < count && int(b.offs[next+1]) <= filled {
				b.layers[next] = sha256.Sum256(data[b.offs[next]:b.offs[next+1]])
				if o.Layer != nil {
					o.Layer(next, data[b.offs[next]:b.offs[next+1]])
				}
				next++
			}
		}
	}()
	filled := hl
	var rerr error
	for filled < len(data) {
		m, err := io.ReadFull(r, data[filled:min(filled+readChunk, len(data))])
		filled += m
		wholeC <- filled
		layerC <- filled
		if err != nil {
			rerr = readErr(err, "data")
			break
		}
	}
	if rerr == nil { // nothing may follow
		var one [1]byte
		if m, _ := r.Read(one[:]); m > 0 {
			rerr = fmt.Errorf("%w: octets after the last layer", ErrMalformed)
		}
	}
	close(wholeC)
	close(layerC)
	wg.Wait()
	if rerr != nil {
		return nil, rerr
	}
	b.replica = ReplicaDigest(b.layers)
	return b, nil
}

func readErr(err error, where string) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return truncated(where)
	}
	return fmt.Errorf("container: reading %s: %w", where, err)
}
