package llamacpp

import (
	"fmt"

	"github.com/kvsp/kvsp"
)

// kv is the engine's KV memory: blocks in host memory, each one buffer of
// K then V of every layer in kvsp-layout-1, converted to and from
// llama.cpp's sequence state when a session starts and as its blocks
// complete.
type kv Engine

func (m *kv) Has(key kvsp.BlockKey) bool { return m.blocks.Has(key) }

func (m *kv) WriteLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	if len(k) != m.sec || len(v) != m.sec {
		return fmt.Errorf("llamacpp: layer %d with sections of %d and %d octets (want %d)", layer, len(k), len(v), m.sec)
	}
	return m.blocks.Write(key, layer, func(p []byte) error {
		o := 2 * m.sec * int(layer)
		copy(p[o:o+m.sec], k)
		copy(p[o+m.sec:o+2*m.sec], v)
		return nil
	})
}

func (m *kv) ReadLayer(key kvsp.BlockKey, layer uint32, k, v []byte) error {
	return m.blocks.Read(key, layer, func(p []byte) error {
		o := 2 * m.sec * int(layer)
		copy(k, p[o:o+m.sec])
		copy(v, p[o+m.sec:o+2*m.sec])
		return nil
	})
}

func (m *kv) Drop(key kvsp.BlockKey)                     { m.blocks.Drop(key) }
func (m *kv) Pin(key kvsp.BlockKey) bool                 { return m.blocks.Pin(key) }
func (m *kv) Unpin(key kvsp.BlockKey) (stillPinned bool) { return m.blocks.Unpin(key) }
