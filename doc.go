// Package kvsp is the protocol core of KVSP, the KV Cache Storage Protocol
// (spec: ../shared/spec/kvsp-draft.txt; requirement IDs R-AREA-n and project
// decisions A-n: ../shared/CONFORMANCE.md).
//
// It holds everything two KVSP parties must compute identically, and nothing
// that talks to a network:
//
//   - the Compatibility Descriptor and its Compatibility ID
//     (section "Compatibility Descriptor and Compatibility ID"): [Descriptor],
//     [CompatID], [ModelDigest], [FileDigest];
//   - Scope Keys, Scope IDs and the keyed Block Key chain
//     (section "Scopes and Block Keys"): [ScopeKey], [ScopeID], [Chain],
//     [BlockKeys];
//   - the typed identifiers carried as lowercase hex ([BlockKey], [CompatID],
//     [ScopeID], [LayerDigest], [Digest]) and the path identifiers of holders
//     and instances ([ResourceID], [NormalizeBaseURI]);
//   - every JSON record of the spec, decoded strictly ([Decode]) and
//     validated (section "Records" and decisions ..A-29);
//   - the problem types of section "Error Handling" as sentinel errors and
//     RFC 9457 problem details ([Problem], [ProblemFor]).
//
// A Block Key names a block together with its whole token prefix:
//
//	K[-1] = 0^32
//	K[i]  = HMAC-SHA-256(scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id ||
//	                     K[i-1] || uint32be(t[iB]) || ... || uint32be(t[iB+B-1]))
//
// A session that grows token by token extends its chain with [Chain.Push]
// without recomputing the prefix:
//
//	ch, _ := kvsp.NewChain(scopeKey, compat, desc.BlockTokens)
//	for _, tok := range generated {
//		if ch.Push(tok) { // a block completed
//			key, _ := ch.Last()
//			publish(key)
//		}
//	}
//
// JSON: this package decodes with github.com/go-json-experiment/json (the
// module that became encoding/json/v2) rather than encoding/json. KVSP needs
// case-sensitive member names (R-REC-2), rejection of duplicate members and
// of invalid UTF-8, and integers that refuse fractions and exponents
// (R-REC-4); the experiment gives all of these in the one decoding pass,
// where encoding/json v1 matches names case-insensitively, keeps the last
// duplicate and would need a second token scan. encoding/json/v2 itself needs
// GOEXPERIMENT=jsonv2 on Go 1.26, which a plain `go build` must not depend on;
// moving to it later is an import change.
package kvsp
