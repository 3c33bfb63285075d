package kvsp

import (
	"strconv"
	"unicode/utf8"
)

// Hand-written JSON encoders for the records on hot paths (lookup
// responses carry up to thousands of records). They produce exactly what
// Marshal produces (TestAppendJSONMatchesMarshal), without reflection or
// allocation.

// appendString appends s as a JSON string, escaping as encoding/json/v2
// does by default (quotes, backslash, control characters; invalid UTF-8
// replaced).
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"':
				b = append(b, '\\', '"')
			case '\\':
				b = append(b, '\\', '\\')
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexdigits[c>>4], hexdigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, "\ufffd"...)
			i++
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

func appendHexString(b []byte, v []byte) []byte {
	b = append(b, '"')
	b = appendHex(b, v)
	return append(b, '"')
}

// AppendJSON appends the record's JSON, as Marshal would.
func (r *ReplicaRecord) AppendJSON(b []byte) []byte {
	b = append(b, `{"block_key":`...)
	b = appendHexString(b, r.BlockKey[:])
	b = append(b, `,"compat_id":`...)
	b = appendHexString(b, r.CompatID[:])
	b = append(b, `,"scope_id":`...)
	b = appendHexString(b, r.ScopeID[:])
	b = append(b, `,"holder":`...)
	b = appendString(b, r.Holder)
	b = append(b, `,"codec":`...)
	b = strconv.AppendUint(b, uint64(r.Codec), 10)
	b = append(b, `,"size":`...)
	b = strconv.AppendUint(b, r.Size, 10)
	b = append(b, `,"digest":"sha-256:`...)
	b = appendHex(b, r.Digest[:])
	b = append(b, '"')
	if len(r.LayerDigests) > 0 {
		b = append(b, `,"layer_digests":[`...)
		for i := range r.LayerDigests {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendHexString(b, r.LayerDigests[i][:])
		}
		b = append(b, ']')
	}
	b = append(b, `,"residency":[`...)
	for i, e := range r.Residency {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, `{"tier":`...)
		b = appendString(b, string(e.Tier))
		b = append(b, `,"layers":[`...)
		b = strconv.AppendUint(b, uint64(e.Layers[0]), 10)
		b = append(b, ',')
		b = strconv.AppendUint(b, uint64(e.Layers[1]), 10)
		b = append(b, ']')
		if e.ReadMbitPerS != 0 {
			b = append(b, `,"read_mbit_per_s":`...)
			b = strconv.AppendUint(b, e.ReadMbitPerS, 10)
		}
		b = append(b, '}')
	}
	b = append(b, `],"ttl_ms":`...)
	b = strconv.AppendUint(b, r.TTLMs, 10)
	if r.MOQTNamespace != "" {
		b = append(b, `,"moqt_namespace":`...)
		b = appendString(b, r.MOQTNamespace)
	}
	return append(b, '}')
}

// AppendJSON appends the response's JSON, as Marshal would.
func (l *LookupResponse) AppendJSON(b []byte) []byte {
	b = append(b, `{"matched":`...)
	b = strconv.AppendInt(b, int64(l.Matched), 10)
	b = append(b, `,"replicas":[`...)
	for i := range l.Replicas {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '[')
		for j := range l.Replicas[i] {
			if j > 0 {
				b = append(b, ',')
			}
			b = l.Replicas[i][j].AppendJSON(b)
		}
		b = append(b, ']')
	}
	b = append(b, ']')
	if len(l.Targets) > 0 {
		b = append(b, `,"targets":[`...)
		for i, t := range l.Targets {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"instance":`...)
			b = appendString(b, t.Instance)
			b = append(b, `,"fetch_us":`...)
			b = strconv.AppendUint(b, t.FetchUs, 10)
			b = append(b, `,"recompute_us":`...)
			b = strconv.AppendUint(b, t.RecomputeUs, 10)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	return append(b, '}')
}
