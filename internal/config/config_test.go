package config

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	for in, want := range map[string]Size{"1GiB": 1 << 30, "512 MiB": 512 << 20, "4096": 4096, "2KiB": 2048, "1TiB": 1 << 40, "7B": 7} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "1GB", "-1", "1.5GiB", "GiB", "99999999999TiB"} {
		if _, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) accepted", bad)
		}
	}
}

// TestValidation: each mistake is reported with the field's name, before
// anything could listen.
func TestValidation(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"c.pem", "k.pem", "ca.pem", "policy.yaml"} {
		os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644)
	}
	os.WriteFile(filepath.Join(dir, "hex.key"), []byte(strings.Repeat("ab", 32)+"\n"), 0o600)
	os.WriteFile(filepath.Join(dir, "short.key"), []byte("0123"), 0o600)
	base := `listen: 127.0.0.1:8443
tls: {cert: c.pem, key: k.pem, client_ca: ca.pem}
policy: policy.yaml
scopes: [{key_file: hex.key}]
index: {base: https://h/is/, max_ttl_ms: 1000, max_lookup_keys: 64}
`
	c, err := Parse([]byte(base), dir)
	if err != nil {
		t.Fatal(err)
	}
	if c.TLS.ClientCert != filepath.Join(dir, "c.pem") || c.Index.Backend != "memory" || len(c.ScopeKeys) != 1 {
		t.Fatalf("defaults: %+v", c)
	}
	if c.MinWriteRate != nil || c.WriteGraceMs != 0 { // absent: server.Config's defaults
		t.Fatalf("min_write_rate %v, write_grace_ms %d when absent", c.MinWriteRate, c.WriteGraceMs)
	}
	for text, want := range map[string]Size{"min_write_rate: 0\n": 0, "min_write_rate: 256KiB\nwrite_grace_ms: 2000\n": 256 << 10} {
		c, err := Parse([]byte(base+text), dir)
		if err != nil || c.MinWriteRate == nil || *c.MinWriteRate != want {
			t.Fatalf("%q: %v %v", text, c, err)
		}
	}
	for field, text := range map[string]string{
		"listen":                       strings.Replace(base, "127.0.0.1:8443", "8443", 1),
		"tls.key":                      strings.Replace(base, "k.pem", "missing.pem", 1),
		"scopes[0].key_file":           strings.Replace(base, "hex.key", "short.key", 1),
		"index.base":                   strings.Replace(base, "https://h/is/", "http://h/is/", 1),
		"index.max_ttl_ms":             strings.Replace(base, "max_ttl_ms: 1000", "max_ttl_ms: 0", 1),
		"index.backend":                strings.Replace(base, "max_lookup_keys: 64", "max_lookup_keys: 64, backend: redis", 1),
		"no role":                      base[:strings.Index(base, "index:")],
		"controller.base":              base + "controller: {base: https://h/is/, index: https://h/is/}\n",
		"controller.state_path":        base + "controller: {base: https://h/pc/, index: https://h/is/, state: bolt}\n",
		"controller.etcd.endpoints":    base + "controller: {base: https://h/pc/, index: https://h/is/, state: etcd}\n",
		"controller.etcd.endpoints[0]": base + "controller: {base: https://h/pc/, index: https://h/is/, state: etcd, etcd: {endpoints: [127.0.0.1:2379]}}\n",
		"controller.min_deadline_ms":   base + "controller: {base: https://h/pc/, index: https://h/is/, min_deadline_ms: 60001}\n",
		"write_grace_ms":               base + "write_grace_ms: 600001\n",
		"field x_index":                strings.Replace(base, "index:", "x_index:", 1) + "index: {base: https://h/is/, max_ttl_ms: 1, max_lookup_keys: 1}\n",
		"holders[0].attach_socket": base + "holders: [{base: https://h/h1/, index: https://h/is/, lease_quota: {octets: 1, max_ttl_ms: 1, max_leases: 1}," +
			" tiers: [{name: host, capacity: 1GiB}], attach_socket: a.sock}]\n",
		"holders[0].tiers[0]": base + "holders: [{base: https://h/h1/, index: https://h/is/, lease_quota: {octets: 1, max_ttl_ms: 1, max_leases: 1}," +
			" tiers: [{name: host, capacity: 1GiB, layers: 4}]}]\n",
		"holders[0].tiers[1]": base + "holders: [{base: https://h/h1/, index: https://h/is/, lease_quota: {octets: 1, max_ttl_ms: 1, max_leases: 1}," +
			" tiers: [{name: host, capacity: 1GiB}, {name: device, capacity: 1GiB, layers: -1}]}]\n",
	} {
		_, err := Parse([]byte(text), dir)
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: err = %v", field, err)
		}
	}
}

// TestLeaseQuotaDefaults (issue item 10): a holder's lease quota takes a
// quarter of its host tier by default, so one client cannot pin all of
// it; the IS's producer-digest pinning is configurable.
func TestLeaseQuotaDefaults(t *testing.T) {
	dir := t.TempDir()
	for _, f := range []string{"c.pem", "k.pem", "ca.pem", "policy.yaml"} {
		os.WriteFile(filepath.Join(dir, f), []byte("x"), 0o644)
	}
	os.WriteFile(filepath.Join(dir, "hex.key"), []byte(strings.Repeat("ab", 32)+"\n"), 0o600)
	base := `listen: 127.0.0.1:8443
tls: {cert: c.pem, key: k.pem, client_ca: ca.pem}
policy: policy.yaml
scopes: [{key_file: hex.key}]
index: {base: https://h/is/, max_ttl_ms: 1000, max_lookup_keys: 64, producer_digests: true}
holders: [{base: https://h/h1/, index: https://h/is/, tiers: [{name: host, capacity: 1GiB}]%s}]
`
	c, err := Parse([]byte(strings.Replace(base, "%s", "", 1)), dir)
	if err != nil {
		t.Fatal(err)
	}
	if q := c.Holders[0].LeaseQuota; q.Octets != 256<<20 || q.MaxTTLMs != 60000 || q.MaxLeases != 1024 {
		t.Fatalf("default lease quota %+v", q)
	}
	if !c.Index.ProducerDigests {
		t.Fatal("index.producer_digests not read")
	}
	if c.Holders[0].MaxReadPerClient != 0 { // absent: holder.Config's default
		t.Fatalf("max_read_per_client %d when absent", c.Holders[0].MaxReadPerClient)
	}
	c, err = Parse([]byte(strings.Replace(base, "%s", ", max_read_per_client: 128MiB", 1)), dir)
	if err != nil || c.Holders[0].MaxReadPerClient != 128<<20 {
		t.Fatalf("max_read_per_client: %v %v", c, err)
	}
}
