// Package quicbulk is a raw QUIC bulk path for block transfers between
// holders and instances: its own ALPN ("kvsp-bulk/1"), one bidirectional
// stream per request, many blocks and layer ranges multiplexed on one
// connection, with the mutual-TLS identities of the HTTPS roles (the
// handshake verifies the client's chain; every request is then authorized
// by the server's own handler, as for HTTP/2 and HTTP/3).
//
// It carries the same requests as HTTPS (block GET with layers=a-b, block
// PUT, leases): the server hands each stream to an http.Handler, and the
// client is an http.RoundTripper, so semantics, problem details, digests
// (Repr-Digest, per-layer KVB1 digests) and authorization are those of the
// HTTP routes, byte for byte. What it leaves out is what bulk transfer does
// not need: QPACK and HTTP/3 framing, and the HTTP/3 defaults of small
// flow-control windows (DefaultConfig sizes them for whole blocks).
//
// # Wire format
//
// Each request opens a bidirectional stream. The client sends a head and
// the request body (Content-Length octets; without Content-Length, a GET,
// HEAD or DELETE has none and other methods' bodies run to the client's
// FIN), the server its response up to its FIN, and the client then ends
// its side (FIN) once it has read the whole response, which tells the
// server the answer arrived (a server's Shutdown waits for it):
//
//	request  = head-length:uvarint method:string target:string fields
//	response = head-length:uvarint status:uvarint fields, then the body up to FIN
//	fields   = count:uvarint (name:string value:string)*
//	string   = length:uvarint octets
//
// head-length counts the octets after it, at most MaxHeadLen. target is
// the origin form of the URI (path and query). Names are HTTP field names
// (tokens, lower case), values HTTP field values. A response body cut
// short is a stream reset with CodeAborted, never a FIN, so a truncated
// block cannot look complete (the KVB1 digests would catch it anyway).
package quicbulk
