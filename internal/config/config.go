// Package config reads and validates the YAML configuration of a kvsp
// process: one file per process, validated completely before anything
// listens, with errors that name the field. Paths are absolute or relative
// to the configuration file. The member names are an interface (external
// conformance checks rely on them): add fields, never rename.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/kvsp/kvsp"
)

// Config is one process's configuration.
type Config struct {
	// Listen is the address (host:port) every role of the process is
	// served on: HTTPS with mutual TLS.
	Listen string `yaml:"listen"`
	// HTTP3 also serves HTTP/3 on the listen port's UDP socket (advertised
	// by Alt-Svc).
	HTTP3 bool `yaml:"http3"`
	// QUICBulk serves the quicbulk path (ALPN kvsp-bulk/1) on the
	// listen port's UDP socket.
	QUICBulk bool `yaml:"quicbulk"`
	// Transport is how this process calls the others: "h2" (default:
	// HTTP/2), "h3" (every call over HTTP/3: its peers serve http3) or
	// "quicbulk" (block GETs and PUTs over the bulk path, falling back to
	// HTTPS for holders that do not serve it; the rest over HTTP/2).
	Transport string `yaml:"transport"`
	// QUICConns is the number of QUIC connections per peer (h3 and
	// quicbulk); default 4 (one connection's packets are processed by one
	// goroutine).
	QUICConns int `yaml:"quic_conns"`
	// UDPBufferBytes is the UDP socket buffer asked for (HTTP/3, quicbulk);
	// default 8 MiB. What the kernel grants less is logged.
	UDPBufferBytes int `yaml:"udp_buffer_bytes"`
	// MetricsListen is the Prometheus listener's address (plain HTTP,
	// /metrics); empty: none.
	MetricsListen string `yaml:"metrics_listen"`
	// TLS names the process's certificates and the CA it trusts.
	TLS TLS `yaml:"tls"`
	// Policy is the policy file: principals, their roles, scopes and
	// speaks_for, API key hashes (reloaded on SIGHUP).
	Policy string `yaml:"policy"`
	// Scopes are the scope keys this process may use (the PC, instances);
	// never given to the IS.
	Scopes []ScopeFile `yaml:"scopes"`
	// Redis is the index's Redis or Valkey (index.backend: redis).
	Redis *Redis `yaml:"redis"`
	// Index is the Index Service role, when this process hosts it.
	Index *Index `yaml:"index"`
	// Controller is the Placement Controller role, when this process hosts it.
	Controller *Controller `yaml:"controller"`
	// Holders are the holders this process hosts.
	Holders []Holder `yaml:"holders"`
	// Instances are the instance agents this process hosts.
	Instances []Instance `yaml:"instances"`
	// Gateway is the OpenAI-compatible API, when this process serves it.
	Gateway   *Gateway     `yaml:"gateway"`
	Dir       string       `yaml:"-"` // the file's directory
	ScopeKeys []ScopeEntry `yaml:"-"` // loaded from Scopes

	// MinWriteRate is the rate (octets per second, "1MiB" allowed) at
	// which a client must read every response once WriteGraceMs has
	// passed: a response whose writes wait for their reader longer than
	// the grace plus their octets at this rate is cut (its stream reset,
	// its HTTP/1.1 connection closed) and its handler stopped (RELIABILITY
	// B11); time a handler spends producing does not count. Defaults
	// 1 MiB/s and 5000 ms; 0 turns it off.
	MinWriteRate *Size `yaml:"min_write_rate"`
	// WriteGraceMs is how long a response's writes may wait for their
	// reader before min_write_rate applies; default 5000.
	WriteGraceMs uint64 `yaml:"write_grace_ms"`
}

// TLS names the PEM files: the listener's certificate, the CA bundle of
// peers, and the certificate this process presents when it calls others.
type TLS struct {
	// Cert is the listener's certificate (PEM).
	Cert string `yaml:"cert"`
	// Key is its private key.
	Key string `yaml:"key"`
	// ClientCA is the CA bundle peers' certificates are verified against.
	ClientCA string `yaml:"client_ca"`
	// ClientCert is the certificate the process presents when it calls
	// others (may be cert).
	ClientCert string `yaml:"client_cert"`
	// ClientKey is its private key.
	ClientKey string `yaml:"client_key"`
}

// ScopeFile is a scope key this process may use (PC, instances); it is
// never given to the IS.
type ScopeFile struct {
	// KeyFile holds a scope key (32 octets in hex); kvsp certs writes a
	// missing one.
	KeyFile string `yaml:"key_file"`
}

// ScopeEntry is a loaded scope key.
type ScopeEntry struct {
	ID  kvsp.ScopeID
	Key kvsp.ScopeKey
}

// Redis is the shared store of the index's redis backend (standalone: one
// address; Redis Cluster: the seed nodes).
type Redis struct {
	// Addrs are host:port of a standalone server, or a Redis Cluster's seed nodes.
	Addrs []string `yaml:"addrs"`
	// Username is the ACL user, if any.
	Username string `yaml:"username"`
	// PasswordFile holds the password (a trailing newline is removed).
	PasswordFile string `yaml:"password_file"`
	// TLSCA, when set, connects with TLS and verifies the server against
	// this CA bundle (records are as confidential as prompts).
	TLSCA string `yaml:"tls_ca"`
}

// Password reads the password file (trailing newline removed).
func (r *Redis) Password() (string, error) {
	if r.PasswordFile == "" {
		return "", nil
	}
	b, err := os.ReadFile(r.PasswordFile)
	if err != nil {
		return "", err
	}
	return strings.TrimRight(string(b), "\r\n"), nil
}

// Index configures the Index Service role.
type Index struct {
	// Base is the IS's base URI (https, ending in /).
	Base string `yaml:"base"`
	// MaxTTLMs is the longest ttl_ms a published record may ask for.
	MaxTTLMs uint64 `yaml:"max_ttl_ms"`
	// MaxLookupKeys is the most Block Keys one lookup may carry.
	MaxLookupKeys int `yaml:"max_lookup_keys"`
	// Backend is memory (this process) or redis (shared, at redis).
	Backend string `yaml:"backend"`
	// Snapshot, for the memory backend, is a file loaded at start and
	// written at shutdown.
	Snapshot string `yaml:"snapshot"`
	// ProducerDigests accepts a holder's record of a block only with the
	// digest the block's producer stated (instances with
	// producer_digests, or the producer role, through PUT
	// producers/{key}): consumers only ever see the producer's digest,
	// and the first holder to publish a key is not trusted for being
	// first (R-SEC-8, RELIABILITY S8, S13).
	ProducerDigests bool `yaml:"producer_digests"`
	// MaxHolderRecords bounds one holder's live records (429 beyond it)
	// and MaxResponseBytes a lookup's answer (413), against amplification
	// (RELIABILITY B9); defaults in controlplane/index.
	MaxHolderRecords int `yaml:"max_holder_records"`
	// MaxResponseBytes: see max_holder_records.
	MaxResponseBytes Size `yaml:"max_response_bytes"`
}

// Controller configures the Placement Controller role.
type Controller struct {
	// Base is the PC's base URI.
	Base string `yaml:"base"`
	// Index is the IS the PC looks prefixes up at.
	Index string `yaml:"index"`
	// State is where instance epochs and sessions are kept: memory (lost
	// on restart), bolt (a file at state_path, created 0600) or etcd
	// (shared by a high-availability group of PCs, of which one leads).
	State string `yaml:"state"`
	// StatePath is the bolt file (state: bolt).
	StatePath string `yaml:"state_path"`
	// Etcd is the group's etcd cluster (state: etcd).
	Etcd *Etcd `yaml:"etcd"`
	// Descriptors are the models it places (their block_tokens), beyond
	// those of the holders and instances of the same process.
	Descriptors []string `yaml:"descriptors"`
	// MinDeadlineMs is the least time a prefetch directive gives its
	// instance to load the blocks (default 10): raise it where the
	// instances' round trips to holders are slower than their links say.
	MinDeadlineMs uint64 `yaml:"min_deadline_ms"`
	// PlacementTTLMs is how long a place's grant lets its instance run the
	// request, and how long a placement never generated holds room there
	// (default 10000).
	PlacementTTLMs uint64 `yaml:"placement_ttl_ms"`
	// MaxShare is the share of an instance's room, and of its pending
	// directives, that one principal and one scope may hold in placements
	// not yet generated (default 0.5; 1: no limit); past it, 429.
	MaxShare float64 `yaml:"max_share"`
}

// maxWriteGraceMs bounds write_grace_ms (ten minutes).
const maxWriteGraceMs = 600000

// maxMinDeadlineMs bounds controller.min_deadline_ms, and
// maxPlacementTTLMs controller.placement_ttl_ms.
const (
	maxMinDeadlineMs  = 60000
	maxPlacementTTLMs = 600000
)

// Holder configures one holder role.
type Holder struct {
	// Base is the holder's base URI, as published in its records.
	Base string `yaml:"base"`
	// Index is the IS it publishes its records at.
	Index string `yaml:"index"`
	// RecordTTLMs is the ttl_ms asked for its records, refreshed before
	// they expire.
	RecordTTLMs uint64 `yaml:"record_ttl_ms"`
	// Descriptors are the models it stores (a PUT of another compat_id is
	// refused, 409); none: any, up to max_block_size.
	Descriptors []string `yaml:"descriptors"`
	// Tiers are its storage tiers: device, host, local-storage.
	Tiers []Tier `yaml:"tiers"`
	// LeaseQuota is its per-client lease quota.
	LeaseQuota LeaseQuota `yaml:"lease_quota"`
	// MasterKeyFile wraps the local-storage tier's data keys; when absent
	// one is generated in the tier's path (mode 0600).
	MasterKeyFile string `yaml:"master_key_file"`
	// AttachSocket, with a device tier, is the Unix socket (created 0600)
	// where engines on the node attach their KV pools (docs/engine-attach.md).
	AttachSocket string `yaml:"attach_socket"`
	// RDMA, when set, serves one-sided RDMA reads of blocks in host memory
	// (POST rdma/reads) on an RDMA device (a binary built with -tags rdma).
	RDMA *RDMA `yaml:"rdma"`
	// MinBodyRate is the average rate (octets per second, "1MiB" allowed)
	// below which a block PUT's body is cut with 408 once BodyGraceMs has
	// passed, its memory reservation released (RELIABILITY B8); defaults
	// 1 MiB/s and 1000 ms.
	MinBodyRate Size `yaml:"min_body_rate"`
	// BodyGraceMs is how long a PUT's body may be slow before
	// min_body_rate applies; default 1000.
	BodyGraceMs uint64 `yaml:"body_grace_ms"`
	// MaxBlockSize bounds a block of a model the holder has no descriptor
	// for: without descriptors, a holder stores any compat_id (a cache
	// server shared by many models); default 64 MiB.
	MaxBlockSize Size `yaml:"max_block_size"`
	// MaxReadPerClient is one client's allowance of memory its block GETs
	// hold beyond the host tier (blocks read back from local storage or
	// copied for one GET, blocks evicted while they are sent): a GET past
	// it is refused with 429, or cut (RELIABILITY B12); default 64 MiB, at
	// least four of the largest block.
	MaxReadPerClient Size `yaml:"max_read_per_client"`
}

// RDMA names an RDMA device.
type RDMA struct {
	// Device is the verbs device name (ibv_devices); "" the first.
	Device string `yaml:"device"`
}

// Tier is one storage tier of a holder.
type Tier struct {
	// Name is the tier: device, host or local-storage.
	Name kvsp.Tier `yaml:"name"`
	// Capacity is the octets the tier holds.
	Capacity Size `yaml:"capacity"`
	// ReadMbitPerS is its read rate, published in records' residency for
	// placement's estimates.
	ReadMbitPerS uint64 `yaml:"read_mbit_per_s"`
	// Path is the local-storage tier's directory (each layer encrypted).
	Path string `yaml:"path"`
	// Device tier only: the accelerator's ordinal, and how many leading
	// layers of each block it takes (0: all; the rest go to host memory).
	Device int `yaml:"device"`
	// Layers is how many leading layers of each block the device tier
	// takes (0: all; the rest go to host memory).
	Layers int `yaml:"layers"`
}

// LeaseQuota is a holder's per-client lease quota (R-LS-5, R-LS-6). Each
// member left out takes its default: a quarter of the host tier's
// capacity (so one client cannot pin the whole tier), 60 s and 1024
// leases.
type LeaseQuota struct {
	// Octets is what one client may hold leased.
	Octets Size `yaml:"octets"`
	// MaxTTLMs is the longest lease.
	MaxTTLMs uint64 `yaml:"max_ttl_ms"`
	// MaxLeases is the leases one client may hold.
	MaxLeases int `yaml:"max_leases"`
}

// Etcd configures the etcd cluster of a PC group (state: etcd).
type Etcd struct {
	// Endpoints are etcd's client URLs; https ones are reached with the
	// process's TLS client certificate, verified against tls.client_ca.
	Endpoints []string `yaml:"endpoints"`
	// Prefix is the group's key prefix; default /kvsp/pc.
	Prefix string `yaml:"prefix"`
	// SessionTTLMs is the leader's lease (how long a standby waits for
	// a silent leader); default 3000.
	SessionTTLMs uint64 `yaml:"session_ttl_ms"`
}

// Instance configures one inference instance agent.
type Instance struct {
	// Base is the instance's base URI.
	Base string `yaml:"base"`
	// Controller is the PC it reports its status to and takes directives from.
	Controller string `yaml:"controller"`
	// Controllers are the other PCs of the controller's group, to fail
	// over to.
	Controllers []string `yaml:"controllers"`
	// Index is the IS it looks prefixes up and states digests at.
	Index string `yaml:"index"`
	// Holder is the holder the blocks it computes are PUT to.
	Holder string `yaml:"holder"`
	// Engine is its engine.
	Engine Engine `yaml:"engine"`
	// Links are the instance's links to holders, reported in its status
	// so placement can estimate fetch times (R-ST-17).
	Links []Link `yaml:"links"`
	// RDMA, when set, loads blocks by one-sided RDMA READ from holders
	// that serve it (GET from the others), on this device (a binary built
	// with -tags rdma).
	RDMA *RDMA `yaml:"rdma"`
	// EpochFile keeps the instance's epoch increasing across restarts even
	// if the clock goes back (R-ST-5); relative to the configuration file.
	EpochFile string `yaml:"epoch_file"`
	// ProducerDigests states at the index the digest of each block the
	// instance computes, before its holder publishes it: set it where the
	// index runs with producer_digests, which accepts holders' records
	// only with their producer's digest.
	ProducerDigests bool `yaml:"producer_digests"`
	// OffloadBuffer bounds the octets of computed blocks waiting for their
	// PUT to the instance's holder (instance.Config.OffloadBuffer; default
	// 16MiB, tuned on kvsp demo): a prompt of more blocks than fit shares
	// only its first ones until a later request computes the rest.
	OffloadBuffer Size `yaml:"offload_buffer"`
}

// Link is an instance's link to a holder.
type Link struct {
	// Holder is a holder's base URI, as in its records.
	Holder string `yaml:"holder"`
	// MbitPerS is the link's rate.
	MbitPerS uint64 `yaml:"mbit_per_s"`
	// RTTUs is its round-trip time in microseconds.
	RTTUs uint64 `yaml:"rtt_us"`
}

// Engine configures an instance's engine.
type Engine struct {
	// Kind is sim (the simulated engine), connected (a real engine on
	// the node attaches its KV pool at AttachSocket, docs/engine-attach.md,
	// and lends the agent pages; its memory is on Device) or llamacpp
	// (llama.cpp runs Model in this process, engine/llamacpp).
	Kind string `yaml:"kind"`
	// Descriptor is the model's descriptor file: required for sim and
	// connected; for llamacpp it is derived from the model, and a file
	// given here must be the same descriptor.
	Descriptor string `yaml:"descriptor"`
	// PrefillTokensPerS is the engine's prefill rate, reported in status
	// (the sim engine runs at it).
	PrefillTokensPerS float64 `yaml:"prefill_tokens_per_s"`
	// DecodeTokensPerS is its decode rate, likewise.
	DecodeTokensPerS float64 `yaml:"decode_tokens_per_s"`
	// AttachSocket (connected) is where the engine attaches its KV pool.
	AttachSocket string `yaml:"attach_socket"`
	// Device (connected) is the GPU ordinal of the engine's memory.
	Device int `yaml:"device"`
	// PrefixCache, false, has the engine (sim or llamacpp) reuse no
	// resident block at prefill (every prompt token computed, as an
	// engine run without prefix caching): kvsp demo's no-cache mode.
	// Default true.
	PrefixCache *bool `yaml:"prefix_cache"`
	// AnswerTokens ([min, max], sim only) makes the simulated model end
	// each answer with its end-of-generation token after a number of
	// tokens in that range drawn from the prompt (A-39's stop); default:
	// answers run to max_tokens.
	AnswerTokens []int `yaml:"answer_tokens"`

	// llamacpp: the GGUF file, its name when its metadata has none, the
	// library's directory (default .cache/llama.cpp, where make deps puts
	// it), and the engine's sizes (zero: engine/llamacpp's defaults).
	Model string `yaml:"model"`
	// Name (llamacpp) is the model's name when its GGUF has none.
	Name string `yaml:"name"`
	// Library (llamacpp) is llama.cpp's directory; default .cache/llama.cpp.
	Library string `yaml:"library"`
	// ContextTokens (llamacpp, sim) is the context's size in tokens: a
	// session's prompt and max_tokens together. sim: default none.
	ContextTokens int `yaml:"context_tokens"`
	// BatchSize (llamacpp) is the sequences decoded at once.
	BatchSize int `yaml:"batch_size"`
	// PrefillChunk (llamacpp) is the prompt tokens prefilled between two
	// decode steps.
	PrefillChunk int `yaml:"prefill_chunk"`
	// Threads (llamacpp) is llama.cpp's CPU threads.
	Threads int `yaml:"threads"`
	// KVCapacity (llamacpp) is the blocks the engine keeps resident.
	KVCapacity int `yaml:"kv_capacity"`
	// FlashAttention (llamacpp) runs flash attention (V not transposed).
	FlashAttention bool `yaml:"flash_attention"`
	// BlockTokens (llamacpp) is the derived descriptor's block_tokens.
	BlockTokens int `yaml:"block_tokens"`
}

// Gateway serves the OpenAI-compatible API (package gateway) at
// https://LISTEN/v1, with the process's certificate (client certificates
// optional; requests authenticate with the policy's API keys). It places
// requests at Controller (and the others of its group) and calls the
// instances with the process's identity.
type Gateway struct {
	// Listen is the API's address (https://LISTEN/v1).
	Listen string `yaml:"listen"`
	// Controller is the PC it places requests at.
	Controller string `yaml:"controller"`
	// Controllers are the other PCs of its group, to fail over to.
	Controllers []string `yaml:"controllers"`
	// Models are the models it serves.
	Models []GatewayModel `yaml:"models"`
	// Library is llama.cpp's directory (default: KVSP_LLAMACPP_LIB, or
	// .cache/llama.cpp at the repository), for the models' tokenizers.
	Library string `yaml:"library"`
	// KeepAliveMs: a stream quiet this long gets an SSE comment; default 2000.
	KeepAliveMs uint64 `yaml:"keep_alive_ms"`
	// MaxBody bounds a request body; default 4MiB.
	MaxBody Size `yaml:"max_body"`
}

// GatewayModel is a model the gateway serves: the GGUF its instances run
// (its tokenizer and chat template are read from it, without the weights).
type GatewayModel struct {
	// ID is the model's name in the API (a request's model, GET /v1/models).
	ID string `yaml:"id"`
	// Model is the GGUF file its instances run.
	Model string `yaml:"model"`
	// BlockTokens is the instances' block_tokens.
	BlockTokens int `yaml:"block_tokens"`
	// ContextTokens bounds a request's prompt and output (the instances'
	// context_tokens); DefaultMaxTokens is the output limit of a request
	// that sets none, MaxTokens the largest it may set.
	ContextTokens int `yaml:"context_tokens"`
	// DefaultMaxTokens: see context_tokens.
	DefaultMaxTokens int `yaml:"default_max_tokens"`
	// MaxTokens: see context_tokens.
	MaxTokens int `yaml:"max_tokens"`
}

func (g *Gateway) validate() error {
	if _, _, err := net.SplitHostPort(g.Listen); err != nil || g.Listen == "" {
		return fieldErr("gateway.listen", "want host:port")
	}
	if err := checkBase("gateway.controller", g.Controller, true); err != nil {
		return err
	}
	for i, b := range g.Controllers {
		if err := checkBase(fmt.Sprintf("gateway.controllers[%d]", i), b, true); err != nil {
			return err
		}
	}
	if len(g.Models) == 0 {
		return fieldErr("gateway.models", "at least one")
	}
	ids := map[string]bool{}
	for i := range g.Models {
		m := &g.Models[i]
		f := fmt.Sprintf("gateway.models[%d]", i)
		if m.ID == "" || ids[m.ID] {
			return fieldErr(f+".id", "required, and unique")
		}
		ids[m.ID] = true
		if _, err := os.Stat(m.Model); err != nil {
			return fieldErr(f+".model", "%v (make deps installs SmolLM2-135M-Instruct into .cache/models)", err)
		}
		if m.BlockTokens == 0 {
			m.BlockTokens = 16
		}
		if m.ContextTokens == 0 {
			m.ContextTokens = 2048
		}
		if m.MaxTokens == 0 {
			m.MaxTokens = min(1024, m.ContextTokens-1)
		}
		if m.DefaultMaxTokens == 0 {
			m.DefaultMaxTokens = min(256, m.MaxTokens)
		}
		if m.DefaultMaxTokens < 1 || m.DefaultMaxTokens > m.MaxTokens || m.MaxTokens >= m.ContextTokens {
			return fieldErr(f, "want 1 <= default_max_tokens <= max_tokens < context_tokens")
		}
	}
	if g.KeepAliveMs == 0 {
		g.KeepAliveMs = 2000
	}
	return nil
}

// Size is a byte count written as an integer or with a KiB, MiB, GiB or
// TiB suffix.
type Size uint64

// UnmarshalYAML parses "1GiB", "512MiB", "4096".
func (s *Size) UnmarshalYAML(n *yaml.Node) error {
	v, err := ParseSize(n.Value)
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// ParseSize parses a size.
func ParseSize(str string) (Size, error) {
	t := strings.TrimSpace(str)
	mult := uint64(1)
	for _, u := range []struct {
		suffix string
		m      uint64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(t, u.suffix) {
			t, mult = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.m
			break
		}
	}
	n, err := strconv.ParseUint(t, 10, 64)
	if err != nil || n > (1<<63)/mult {
		return 0, fmt.Errorf("size %q: want an integer with an optional KiB, MiB, GiB or TiB suffix", str)
	}
	return Size(n * mult), nil
}

// Load reads, resolves and validates a configuration file.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	return Parse(data, filepath.Dir(abs))
}

// Parse parses a configuration whose relative paths are relative to dir,
// validates it completely and loads its scope keys.
func Parse(data []byte, dir string) (*Config, error) {
	c, err := ParseUnvalidated(data, dir)
	if err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return c, nil
}

// ParseUnvalidated decodes a configuration and resolves its paths without
// checking anything else: for `kvsp certs`, which writes the files the
// configuration names.
func ParseUnvalidated(data []byte, dir string) (*Config, error) {
	var c Config
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	c.Dir = dir
	c.resolve()
	return &c, nil
}

// Path resolves a configured path against the file's directory.
func (c *Config) Path(p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(c.Dir, p)
}

func (c *Config) resolve() {
	for _, p := range []*string{&c.TLS.Cert, &c.TLS.Key, &c.TLS.ClientCA, &c.TLS.ClientCert, &c.TLS.ClientKey, &c.Policy} {
		*p = c.Path(*p)
	}
	if c.TLS.ClientCert == "" && c.TLS.ClientKey == "" {
		c.TLS.ClientCert, c.TLS.ClientKey = c.TLS.Cert, c.TLS.Key
	}
	for i := range c.Scopes {
		c.Scopes[i].KeyFile = c.Path(c.Scopes[i].KeyFile)
	}
	if c.Index != nil {
		c.Index.Snapshot = c.Path(c.Index.Snapshot)
	}
	if c.Redis != nil {
		c.Redis.PasswordFile = c.Path(c.Redis.PasswordFile)
		c.Redis.TLSCA = c.Path(c.Redis.TLSCA)
	}
	for i := range c.Holders {
		h := &c.Holders[i]
		for j := range h.Descriptors {
			h.Descriptors[j] = c.Path(h.Descriptors[j])
		}
		for j := range h.Tiers {
			h.Tiers[j].Path = c.Path(h.Tiers[j].Path)
		}
		h.MasterKeyFile = c.Path(h.MasterKeyFile)
		h.AttachSocket = c.Path(h.AttachSocket)
	}
	for i := range c.Instances {
		c.Instances[i].Engine.Descriptor = c.Path(c.Instances[i].Engine.Descriptor)
		c.Instances[i].Engine.AttachSocket = c.Path(c.Instances[i].Engine.AttachSocket)
		c.Instances[i].Engine.Model = c.Path(c.Instances[i].Engine.Model)
		c.Instances[i].Engine.Library = c.Path(c.Instances[i].Engine.Library)
		c.Instances[i].EpochFile = c.Path(c.Instances[i].EpochFile)
	}
	if c.Gateway != nil {
		c.Gateway.Library = c.Path(c.Gateway.Library)
		for i := range c.Gateway.Models {
			c.Gateway.Models[i].Model = c.Path(c.Gateway.Models[i].Model)
		}
	}
	if c.Controller != nil {
		if c.Controller.StatePath != "" {
			c.Controller.StatePath = c.Path(c.Controller.StatePath)
		}
		for j := range c.Controller.Descriptors {
			c.Controller.Descriptors[j] = c.Path(c.Controller.Descriptors[j])
		}
	}
}

func fieldErr(field string, format string, args ...any) error {
	return fmt.Errorf("%s: %s", field, fmt.Sprintf(format, args...))
}

func checkBase(field, s string, required bool) error {
	if s == "" {
		if required {
			return fieldErr(field, "required")
		}
		return nil
	}
	if err := kvsp.ValidateBaseURI(field, s); err != nil {
		return err
	}
	return nil
}

func checkFile(field, p string) error {
	if p == "" {
		return fieldErr(field, "required")
	}
	if _, err := os.Stat(p); err != nil {
		return fieldErr(field, "%v", err)
	}
	return nil
}

// validate checks the configuration section by section, in the order
// its errors are reported, and fills the defaults; each section has its
// own method.
func (c *Config) validate() error {
	if err := c.validateProcess(); err != nil {
		return err
	}
	if c.Redis != nil {
		if err := c.Redis.validate(); err != nil {
			return err
		}
	}
	if c.Index == nil && c.Controller == nil && len(c.Holders) == 0 && len(c.Instances) == 0 && c.Gateway == nil {
		return errors.New("no role: configure at least one of index, controller, holders, instances, gateway")
	}
	if c.Gateway != nil {
		if err := c.Gateway.validate(); err != nil {
			return err
		}
	}
	if err := c.loadScopes(); err != nil {
		return err
	}
	bases := basePaths{}
	if c.Index != nil {
		if err := c.Index.validate(bases, c.Redis); err != nil {
			return err
		}
	}
	if c.Controller != nil {
		if err := c.Controller.validate(bases); err != nil {
			return err
		}
	}
	sockets := map[string]string{} // attach socket -> the field that has it
	for i := range c.Holders {
		f := fmt.Sprintf("holders[%d]", i)
		if err := c.Holders[i].validate(f, bases); err != nil {
			return err
		}
		if sock := c.Holders[i].AttachSocket; sock != "" {
			sockets[sock] = f + ".attach_socket"
		}
	}
	for i := range c.Instances {
		if err := c.Instances[i].validate(fmt.Sprintf("instances[%d]", i), bases, sockets); err != nil {
			return err
		}
	}
	return nil
}

// basePaths are the base paths the roles claimed, by the field that
// claimed each: two roles of one process cannot share one.
type basePaths map[string]string

func (bases basePaths) claim(field, base string) error {
	u := strings.SplitN(strings.TrimPrefix(base, "https://"), "/", 2)
	path := "/"
	if len(u) == 2 {
		path += u[1]
	}
	if prev, dup := bases[path]; dup {
		return fieldErr(field, "base path %s is already used by %s", path, prev)
	}
	bases[path] = field
	return nil
}

// validateProcess checks what the process itself listens and calls
// with: its addresses, transport and TLS files.
func (c *Config) validateProcess() error {
	if _, _, err := net.SplitHostPort(c.Listen); err != nil || c.Listen == "" {
		return fieldErr("listen", "want host:port")
	}
	switch c.Transport {
	case "", "h2", "h3", "quicbulk":
	default:
		return fieldErr("transport", "want h2, h3 or quicbulk")
	}
	if c.QUICConns < 0 || c.QUICConns > 64 {
		return fieldErr("quic_conns", "want 1 to 64")
	}
	if c.UDPBufferBytes < 0 {
		return fieldErr("udp_buffer_bytes", "want a size in octets")
	}
	if c.WriteGraceMs > maxWriteGraceMs {
		return fieldErr("write_grace_ms", "want at most %d", maxWriteGraceMs)
	}
	if c.MetricsListen != "" {
		if _, _, err := net.SplitHostPort(c.MetricsListen); err != nil {
			return fieldErr("metrics_listen", "want host:port")
		}
	}
	for _, f := range []struct{ name, path string }{
		{"tls.cert", c.TLS.Cert}, {"tls.key", c.TLS.Key}, {"tls.client_ca", c.TLS.ClientCA},
		{"tls.client_cert", c.TLS.ClientCert}, {"tls.client_key", c.TLS.ClientKey}, {"policy", c.Policy},
	} {
		if err := checkFile(f.name, f.path); err != nil {
			return err
		}
	}
	return nil
}

// validate checks the Redis section (the addresses and files it names).
func (r *Redis) validate() error {
	for i, a := range r.Addrs {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return fieldErr(fmt.Sprintf("redis.addrs[%d]", i), "want host:port")
		}
	}
	if r.PasswordFile != "" {
		if err := checkFile("redis.password_file", r.PasswordFile); err != nil {
			return err
		}
	}
	if r.TLSCA != "" {
		if err := checkFile("redis.tls_ca", r.TLSCA); err != nil {
			return err
		}
	}
	return nil
}

// loadScopes reads the scope keys.
func (c *Config) loadScopes() error {
	for i, s := range c.Scopes {
		f := fmt.Sprintf("scopes[%d].key_file", i)
		data, err := os.ReadFile(s.KeyFile)
		if err != nil {
			return fieldErr(f, "%v", err)
		}
		k, err := kvsp.ScopeKeyFromFile(data)
		if err != nil {
			return fieldErr(f, "%v", err)
		}
		c.ScopeKeys = append(c.ScopeKeys, ScopeEntry{ID: k.ID(), Key: k})
	}
	return nil
}

// validate checks the index; a Redis backend needs redis.
func (x *Index) validate(bases basePaths, redis *Redis) error {
	if err := checkBase("index.base", x.Base, true); err != nil {
		return err
	}
	if err := bases.claim("index.base", x.Base); err != nil {
		return err
	}
	if x.MaxTTLMs == 0 || x.MaxTTLMs > kvsp.MaxJSONInt {
		return fieldErr("index.max_ttl_ms", "required, 1..2^53-1")
	}
	if x.MaxLookupKeys <= 0 {
		return fieldErr("index.max_lookup_keys", "required, at least 1 (R-SEC-14: the lookup size quota is REQUIRED)")
	}
	switch x.Backend {
	case "", "memory":
		x.Backend = "memory"
	case "redis":
		if redis == nil || len(redis.Addrs) == 0 {
			return fieldErr("index.backend", "redis needs redis.addrs")
		}
	default:
		return fieldErr("index.backend", "%q: want memory or redis", x.Backend)
	}
	return nil
}

// validate checks the controller and fills its defaults.
func (x *Controller) validate(bases basePaths) error {
	if err := checkBase("controller.base", x.Base, true); err != nil {
		return err
	}
	if err := bases.claim("controller.base", x.Base); err != nil {
		return err
	}
	if err := checkBase("controller.index", x.Index, true); err != nil {
		return err
	}
	switch x.State {
	case "", "memory":
		x.State = "memory"
	case "bolt":
		if x.StatePath == "" {
			return fieldErr("controller.state_path", "required with state: bolt")
		}
	case "etcd":
		if x.Etcd == nil || len(x.Etcd.Endpoints) == 0 {
			return fieldErr("controller.etcd.endpoints", "required with state: etcd")
		}
		for j, e := range x.Etcd.Endpoints {
			if !strings.HasPrefix(e, "https://") && !strings.HasPrefix(e, "http://") {
				return fieldErr(fmt.Sprintf("controller.etcd.endpoints[%d]", j), "%q: want an http or https URL", e)
			}
		}
	default:
		return fieldErr("controller.state", "%q: want memory, bolt or etcd", x.State)
	}
	for j, d := range x.Descriptors {
		if err := checkDescriptor(fmt.Sprintf("controller.descriptors[%d]", j), d); err != nil {
			return err
		}
	}
	if x.MinDeadlineMs > maxMinDeadlineMs {
		return fieldErr("controller.min_deadline_ms", "%d: at most %d (a directive's deadline is capped at 2 s anyway)", x.MinDeadlineMs, maxMinDeadlineMs)
	}
	if x.PlacementTTLMs > maxPlacementTTLMs {
		return fieldErr("controller.placement_ttl_ms", "%d: at most %d", x.PlacementTTLMs, maxPlacementTTLMs)
	}
	if !(x.MaxShare >= 0 && x.MaxShare <= 1) {
		return fieldErr("controller.max_share", "%v: a share in (0, 1]", x.MaxShare)
	}
	return nil
}

// validate checks the holder at field f and fills its defaults.
func (h *Holder) validate(f string, bases basePaths) error {
	if err := checkBase(f+".base", h.Base, true); err != nil {
		return err
	}
	if err := bases.claim(f+".base", h.Base); err != nil {
		return err
	}
	if err := checkBase(f+".index", h.Index, true); err != nil {
		return err
	}
	if h.RecordTTLMs == 0 {
		h.RecordTTLMs = 60000
	}
	for j, d := range h.Descriptors {
		if err := checkDescriptor(fmt.Sprintf("%s.descriptors[%d]", f, j), d); err != nil {
			return err
		}
	}
	if len(h.Tiers) == 0 {
		return fieldErr(f+".tiers", "at least one tier")
	}
	seen := map[kvsp.Tier]bool{}
	for j, t := range h.Tiers {
		tf := fmt.Sprintf("%s.tiers[%d]", f, j)
		if !t.Name.Valid() {
			return fieldErr(tf+".name", "%q is not in the KVSP Storage Tiers registry", t.Name)
		}
		if seen[t.Name] {
			return fieldErr(tf+".name", "%s listed twice", t.Name)
		}
		seen[t.Name] = true
		if t.Capacity == 0 {
			return fieldErr(tf+".capacity", "required")
		}
		if t.Name.IsStorage() && t.Path == "" {
			return fieldErr(tf+".path", "required for %s", t.Name)
		}
		if t.Name != kvsp.TierDevice && (t.Device != 0 || t.Layers != 0) {
			return fieldErr(tf, "device and layers belong to the device tier only")
		}
		if t.Layers < 0 || t.Device < 0 {
			return fieldErr(tf, "device and layers cannot be negative")
		}
	}
	if h.AttachSocket != "" {
		hasDevice := false
		for _, t := range h.Tiers {
			hasDevice = hasDevice || t.Name == kvsp.TierDevice
		}
		if !hasDevice {
			return fieldErr(f+".attach_socket", "an engine's memory is served by the device tier: configure one")
		}
	}
	q := &h.LeaseQuota
	var host Size
	for _, t := range h.Tiers {
		if t.Name == kvsp.TierHost {
			host = t.Capacity
		}
	}
	switch {
	case q.MaxLeases < 0:
		return fieldErr(f+".lease_quota.max_leases", "at least 1 (R-LS-5, R-LS-6)")
	case q.MaxTTLMs > kvsp.MaxJSONInt:
		return fieldErr(f+".lease_quota.max_ttl_ms", "1..2^53-1")
	}
	if q.Octets == 0 {
		q.Octets = max(host/4, 1)
	}
	if q.MaxTTLMs == 0 {
		q.MaxTTLMs = 60000
	}
	if q.MaxLeases == 0 {
		q.MaxLeases = 1024
	}
	return nil
}

// validate checks the instance at field f; sockets are the attach
// sockets taken already, to which it adds its engine's.
func (x *Instance) validate(f string, bases basePaths, sockets map[string]string) error {
	if sock := x.Engine.AttachSocket; sock != "" {
		if prev, dup := sockets[sock]; dup {
			return fieldErr(f+".engine.attach_socket", "%s is %s already", sock, prev)
		}
		sockets[sock] = f + ".engine.attach_socket"
	}
	for _, b := range []struct {
		name string
		v    string
	}{{".base", x.Base}, {".controller", x.Controller}, {".index", x.Index}, {".holder", x.Holder}} {
		// An instance without a holder of its own stores nothing it
		// computes (kvsp demo's local and none modes).
		if err := checkBase(f+b.name, b.v, b.name != ".holder"); err != nil {
			return err
		}
	}
	if err := bases.claim(f+".base", x.Base); err != nil {
		return err
	}
	for j, pc := range x.Controllers {
		if err := checkBase(fmt.Sprintf("%s.controllers[%d]", f, j), pc, true); err != nil {
			return err
		}
	}
	if a := x.Engine.AnswerTokens; a != nil && (x.Engine.Kind != "sim" || len(a) != 2 || a[0] < 1 || a[1] < a[0]) {
		return fieldErr(f+".engine.answer_tokens", "[min, max] with 1 <= min <= max, for kind: sim (a real model ends its answers itself)")
	}
	if x.Engine.PrefixCache != nil && x.Engine.Kind == "connected" {
		return fieldErr(f+".engine.prefix_cache", "a connected engine's prefix cache is the engine's own (kind: sim and llamacpp can run without theirs)")
	}
	switch x.Engine.Kind {
	case "sim":
		if x.Engine.PrefillTokensPerS <= 0 || x.Engine.DecodeTokensPerS <= 0 {
			return fieldErr(f+".engine", "prefill_tokens_per_s and decode_tokens_per_s must be positive")
		}
		if x.Engine.ContextTokens < 0 || x.Engine.ContextTokens > 1<<20 {
			return fieldErr(f+".engine.context_tokens", "want 0 (none) to 1048576")
		}
	case "connected":
		if x.Engine.AttachSocket == "" {
			return fieldErr(f+".engine.attach_socket", "required with kind: connected")
		}
	case "llamacpp":
		if x.Engine.Model == "" {
			return fieldErr(f+".engine.model", "required with kind: llamacpp (a GGUF file)")
		}
		for _, n := range []struct {
			name string
			v    int
		}{{"context_tokens", x.Engine.ContextTokens}, {"batch_size", x.Engine.BatchSize}, {"prefill_chunk", x.Engine.PrefillChunk},
			{"threads", x.Engine.Threads}, {"kv_capacity", x.Engine.KVCapacity}, {"block_tokens", x.Engine.BlockTokens}} {
			if n.v < 0 {
				return fieldErr(f+".engine."+n.name, "must not be negative")
			}
		}
	default:
		return fieldErr(f+".engine.kind", "%q: want sim, connected or llamacpp", x.Engine.Kind)
	}
	if x.Engine.Kind != "llamacpp" || x.Engine.Descriptor != "" {
		if err := checkDescriptor(f+".engine.descriptor", x.Engine.Descriptor); err != nil {
			return err
		}
	}
	for j, l := range x.Links {
		lf := fmt.Sprintf("%s.links[%d]", f, j)
		if err := checkBase(lf+".holder", l.Holder, true); err != nil {
			return err
		}
		if l.MbitPerS == 0 {
			return fieldErr(lf+".mbit_per_s", "required, at least 1")
		}
	}
	return nil
}

func checkDescriptor(field, path string) error {
	if err := checkFile(field, path); err != nil {
		return err
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return fieldErr(field, "%v", err)
	}
	if _, err := kvsp.ParseDescriptor(data); err != nil {
		return fieldErr(field, "%v", err)
	}
	return nil
}

// Roles returns the roles this process hosts, for its principal.
func (c *Config) Roles() []string {
	var r []string
	if c.Controller != nil {
		r = append(r, "controller")
	}
	if c.Index != nil {
		r = append(r, "index")
	}
	if len(c.Holders) > 0 {
		r = append(r, "holder")
	}
	if len(c.Instances) > 0 {
		r = append(r, "instance")
	}
	if c.Gateway != nil {
		r = append(r, "client") // the gateway places and generates for its API keys' scopes
	}
	return r
}

// SpeaksFor returns the base URIs this process publishes or reports for.
func (c *Config) SpeaksFor() []string {
	var b []string
	for _, h := range c.Holders {
		b = append(b, h.Base)
	}
	for _, x := range c.Instances {
		b = append(b, x.Base)
	}
	return b
}
