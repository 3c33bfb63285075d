package kvsp

// ProducerRecord is a producer's statement of a block's digest (kvsp's
// extension of the Index Service, PUT {is}producers/{block_key}): the
// instance that computed the block says which replica digest it has,
// before its holder publishes a replica of it. With the IS's
// producer_digests, a holder's replica record is accepted only if its
// digest is the one its producer stated, so consumers see only
// replicas whose digest matches that of the producer (spec "Security
// Considerations", R-SEC-8): the first holder to publish a key is not
// trusted because it was first (RELIABILITY S13).
type ProducerRecord struct {
	BlockKey BlockKey `json:"block_key"`
	CompatID CompatID `json:"compat_id"`
	ScopeID  ScopeID  `json:"scope_id"`
	// Producer is the base URI of the instance that computed the block:
	// the identity that sends the record must speak for it.
	Producer string `json:"producer"`
	// Digest is the replica digest of the block (all the model's layers).
	Digest Digest `json:"digest"`
	TTLMs  uint64 `json:"ttl_ms"`
}

// Validate implements Validator.
func (r *ProducerRecord) Validate() error {
	switch {
	case r.BlockKey.IsZero():
		return invalidf("producer record: block_key: required")
	case r.CompatID.IsZero():
		return invalidf("producer record: compat_id: required")
	case r.ScopeID.IsZero():
		return invalidf("producer record: scope_id: required")
	case r.Digest.IsZero():
		return invalidf("producer record: digest: required")
	case r.TTLMs == 0:
		return invalidf("producer record: ttl_ms: required, at least 1")
	}
	if err := checkInt("producer record: ttl_ms", r.TTLMs); err != nil {
		return err
	}
	return ValidateBaseURI("producer record: producer", r.Producer)
}
