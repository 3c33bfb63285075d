package gpu

import (
	"errors"
	"fmt"
)

// Region is a span of a device buffer.
type Region struct{ Off, Len int64 }

// Stager moves data between device memory and the host through two pinned
// staging buffers on two streams, so that device copies overlap the host's
// work: WriteTo copies region i+1 device-to-host while region i is being
// written (to a socket); Upload queues each host-to-device copy and
// returns while it runs, so the next piece can be received meanwhile. A
// Stager is used by one goroutine at a time.
type Stager struct {
	d    *Device
	size int64
	buf  [2]*HostBuffer
	s    [2]*Stream
	busy [2]bool // an upload is queued on that side
	next int     // the side the next upload uses
}

// NewStager allocates a stager whose staging buffers hold size octets.
func (d *Device) NewStager(size int64) (*Stager, error) {
	st := &Stager{d: d, size: size}
	for i := range 2 {
		b, err := d.AllocHost(size)
		if err != nil {
			st.Close()
			return nil, err
		}
		st.buf[i] = b
		s, err := d.NewStream()
		if err != nil {
			st.Close()
			return nil, err
		}
		st.s[i] = s
	}
	return st, nil
}

// Size is the staging buffers' size: the largest piece moved at once.
func (st *Stager) Size() int64 { return st.size }

// WriteTo writes the regions of b, in order, to write, through the staging
// buffers: each piece (a region, or a part of one larger than Size) is
// passed to write once copied; the copy of the next piece runs while
// write runs. The slice passed to write is valid until write returns.
func (st *Stager) WriteTo(b *Buffer, regions []Region, write func(p []byte) error) error {
	if err := st.Flush(); err != nil {
		return err
	}
	var pieces []Region
	for _, r := range regions {
		if r.Off < 0 || r.Len < 0 || r.Off+r.Len > b.Len() {
			return fmt.Errorf("gpu: region [%d, +%d) outside a %d-octet buffer", r.Off, r.Len, b.Len())
		}
		for off := r.Off; off < r.Off+r.Len; off += st.size {
			pieces = append(pieces, Region{off, min(st.size, r.Off+r.Len-off)})
		}
	}
	if len(pieces) == 0 {
		return nil
	}
	if err := b.CopyOutAsync(st.buf[0], 0, pieces[0].Off, pieces[0].Len, st.s[0]); err != nil {
		return err
	}
	for i, p := range pieces {
		side := i % 2
		if i+1 < len(pieces) { // the other side was written out at i-1
			q := pieces[i+1]
			if err := b.CopyOutAsync(st.buf[1-side], 0, q.Off, q.Len, st.s[1-side]); err != nil {
				st.s[side].Sync()
				return err
			}
		}
		if err := st.s[side].Sync(); err != nil {
			st.s[1-side].Sync()
			return err
		}
		if err := write(st.buf[side].Bytes()[:p.Len]); err != nil {
			st.s[1-side].Sync() // nothing in flight on return
			return err
		}
	}
	return nil
}

// Upload copies p (at most Size octets) to b at off: p is copied into a
// free staging buffer and the device copy is queued, so Upload returns
// while it runs and p may be reused at once. Flush waits for every queued
// copy.
func (st *Stager) Upload(b *Buffer, off int64, p []byte) error {
	n := int64(len(p))
	if n > st.size {
		return fmt.Errorf("gpu: upload of %d octets through %d-octet staging", n, st.size)
	}
	if off < 0 || off+n > b.Len() {
		return fmt.Errorf("gpu: upload of %d octets at %d outside a %d-octet buffer", n, off, b.Len())
	}
	side := st.next
	st.next = 1 - side
	if st.busy[side] { // its previous copy must be done before its buffer is reused
		st.busy[side] = false
		if err := st.s[side].Sync(); err != nil {
			return err
		}
	}
	copy(st.buf[side].Bytes(), p)
	if err := b.CopyInAsync(off, st.buf[side], 0, n, st.s[side]); err != nil {
		return err
	}
	st.busy[side] = true
	return nil
}

// Flush waits for the queued uploads.
func (st *Stager) Flush() error {
	var errs []error
	for i := range 2 {
		if st.busy[i] {
			st.busy[i] = false
			errs = append(errs, st.s[i].Sync())
		}
	}
	return errors.Join(errs...)
}

// Close waits for queued work and frees the staging buffers and streams.
func (st *Stager) Close() {
	st.Flush()
	for i := range 2 {
		if st.s[i] != nil {
			st.s[i].Close()
		}
		if st.buf[i] != nil {
			st.buf[i].Free()
		}
	}
}
