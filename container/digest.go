package container

import (
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"strings"
)

// Digest is a SHA-256 value.
type Digest = [32]byte

// LayerDigest returns SHA-256(K || V) (R-CNT-12).
func LayerDigest(k, v []byte) Digest {
	h := sha256.New()
	h.Write(k)
	h.Write(v)
	var d Digest
	h.Sum(d[:0])
	return d
}

// ReplicaDigest returns SHA-256 over the raw 32-octet layer digests in
// ascending layer order (R-CNT-13, A-8; hex text would give another value).
func ReplicaDigest(layers []Digest) Digest {
	h := sha256.New()
	for i := range layers {
		h.Write(layers[i][:])
	}
	var d Digest
	h.Sum(d[:0])
	return d
}

// ReprDigest formats a container digest as an RFC 9530 Repr-Digest field
// value: sha-256=:<base64>.
func ReprDigest(d Digest) string {
	return "sha-256=:" + base64.StdEncoding.EncodeToString(d[:]) + ":"
}

// ParseReprDigest extracts the sha-256 member of a Repr-Digest (or
// Content-Digest) field value, an RFC 8941 dictionary; other algorithms
// are ignored. A field without sha-256 is an error.
func ParseReprDigest(field string) (Digest, error) {
	var d Digest
	for _, member := range strings.Split(field, ",") {
		member = strings.Trim(member, " \t")
		key, val, ok := strings.Cut(member, "=")
		if !ok || key != "sha-256" {
			continue
		}
		if i := strings.IndexByte(val, ';'); i >= 0 { // parameters
			val = val[:i]
		}
		if len(val) < 2 || val[0] != ':' || val[len(val)-1] != ':' {
			return d, fmt.Errorf("container: Repr-Digest sha-256 is not a byte sequence")
		}
		b, err := base64.StdEncoding.Strict().DecodeString(val[1 : len(val)-1])
		if err != nil || len(b) != len(d) {
			return d, fmt.Errorf("container: Repr-Digest sha-256 is not 32 octets of base64")
		}
		copy(d[:], b)
		return d, nil
	}
	return d, fmt.Errorf("container: Repr-Digest has no sha-256 member")
}
