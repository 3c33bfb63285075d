package main

import (
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/container"
)

// geometryOf maps a descriptor to the container's geometry.
func geometryOf(d kvsp.Descriptor) (container.Geometry, error) {
	et, ok := container.ParseElemType(string(d.KVDType))
	if !ok {
		return container.Geometry{}, fmt.Errorf("kv_dtype %q has no container element type", d.KVDType)
	}
	return container.Geometry{Layers: uint32(d.Layers), BlockTokens: uint32(d.BlockTokens), KVHeads: uint32(d.KVHeads), HeadDim: uint32(d.HeadDim), Elem: et}, nil
}

func loadDescriptor(path string) (kvsp.Descriptor, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return kvsp.Descriptor{}, err
	}
	return kvsp.ParseDescriptor(data)
}

// cmdInspect decodes and verifies a KVB1 file and prints its header,
// digests and layer table.
func cmdInspect(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("inspect", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	descPath := fl.String("descriptor", "", "descriptor of the block's model (its geometry is checked)")
	digest := fl.String("repr-digest", "", "expected Repr-Digest (sha-256=:...:) to verify")
	if err := fl.Parse(args); err != nil || *descPath == "" || fl.NArg() != 1 {
		return usageError("inspect takes --descriptor FILE [--repr-digest VALUE] BLOCK.kvb")
	}
	d, err := loadDescriptor(*descPath)
	if err != nil {
		return fmt.Errorf("descriptor: %w", err)
	}
	g, err := geometryOf(d)
	if err != nil {
		return err
	}
	data, err := os.ReadFile(fl.Arg(0))
	if err != nil {
		return err
	}
	b, err := container.OpenBlock(data, g)
	if err != nil {
		return err
	}
	h := b.Header()
	codec := "unregistered"
	if c := container.LookupCodec(h.Codec); c != nil {
		codec = c.Name()
	}
	cd, rd := b.ContainerDigest(), b.ReplicaDigest()
	fmt.Fprintf(stdout, "KVB1 version 1, codec 0x%04x (%s), layers %d-%d of %d, %d tokens\n", h.Codec, codec, h.FirstLayer, h.LastLayer(), d.Layers, h.TokenCount)
	fmt.Fprintf(stdout, "size %d octets (header %d, K and V sections %d)\n", len(data), h.Len(), b.PayloadSize())
	fmt.Fprintf(stdout, "Repr-Digest: %s\n", container.ReprDigest(cd))
	fmt.Fprintf(stdout, "replica digest over these layers: sha-256:%s\n", hex.EncodeToString(rd[:]))
	if *digest != "" {
		want, err := container.ParseReprDigest(*digest)
		if err != nil {
			return err
		}
		if want != cd {
			return fmt.Errorf("%w: Repr-Digest differs", container.ErrDigestMismatch)
		}
		fmt.Fprintln(stdout, "Repr-Digest verified")
	}
	tw := tabwriter.NewWriter(stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "layer\tK octets\tV octets\tlayer digest")
	for i, l := range h.Layers {
		ld := b.LayerDigests()[i]
		fmt.Fprintf(tw, "%d\t%d\t%d\t%s\n", h.FirstLayer+uint32(i), l.K, l.V, hex.EncodeToString(ld[:]))
	}
	return tw.Flush()
}
