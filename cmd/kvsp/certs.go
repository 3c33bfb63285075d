package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/config"
	"github.com/kvsp/kvsp/internal/pki"
)

type policyOut struct {
	Principals []policyPrincipal `yaml:"principals"`
	APIKeys    []policyAPIKey    `yaml:"api_keys,omitempty"`
}

type policyAPIKey struct {
	SHA256    string `yaml:"sha256"`
	Principal string `yaml:"principal"`
	Scope     string `yaml:"scope"`
}

type policyPrincipal struct {
	ID        string   `yaml:"id"`
	Roles     []string `yaml:"roles,flow"`
	SpeaksFor []string `yaml:"speaks_for,flow,omitempty"`
	Scopes    []string `yaml:"scopes,flow"`
}

// cmdCerts writes a development CA, the process's certificate (server and
// client, one identity carrying every role the configuration hosts), a
// client certificate for tools, missing scope key files, and the matching
// policy file, all where the configuration names them.
func cmdCerts(args []string, stdout io.Writer) error {
	fl := flag.NewFlagSet("certs", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	path := fl.String("config", "", "configuration file whose tls, policy and scopes files to write")
	trust := fl.String("trust-domain", "kvsp.local", "SPIFFE trust domain of the identities")
	validity := fl.Duration("validity", 365*24*time.Hour, "certificate validity")
	var engines []string
	fl.Func("engine", "also an engine's identity NAME (roles producer and client, every scope; NAME.pem, NAME.key): a vLLM engine's connector, say", func(s string) error {
		if !engineName.MatchString(s) {
			return fmt.Errorf("engine name %q: lowercase letters, digits and -", s)
		}
		engines = append(engines, s)
		return nil
	})
	perRole := fl.Bool("per-role", false, "also one identity per role (role-ROLE.pem, role-ROLE.key): controller, index, holder, instance, client and producer, each with that role alone, every scope, speaking for the configuration's bases of its role")
	if err := fl.Parse(args); err != nil || *path == "" || fl.NArg() != 0 {
		return usageError("certs takes --config FILE [--trust-domain D] [--validity DURATION] [--engine NAME ...] [--per-role]")
	}
	data, err := os.ReadFile(*path)
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(*path)
	if err != nil {
		return err
	}
	dir := filepath.Dir(abs)
	c, err := config.ParseUnvalidated(data, dir)
	if err != nil {
		return err
	}
	for _, f := range []struct{ name, path string }{{"tls.cert", c.TLS.Cert}, {"tls.key", c.TLS.Key}, {"tls.client_ca", c.TLS.ClientCA}, {"policy", c.Policy}} {
		if f.path == "" {
			return fmt.Errorf("config: %s: required", f.name)
		}
	}
	host, _, err := net.SplitHostPort(c.Listen)
	if err != nil {
		return fmt.Errorf("config: listen: want host:port")
	}

	caCert, caKey := c.TLS.ClientCA, filepath.Join(filepath.Dir(c.TLS.ClientCA), "ca.key")
	ca, err := pki.LoadCA(caCert, caKey)
	switch {
	case err == nil:
		fmt.Fprintf(stdout, "reusing CA %s\n", caCert)
	case errors.Is(err, fs.ErrNotExist):
		if ca, err = pki.NewCA("kvsp development CA", *validity); err != nil {
			return err
		}
		if err := ca.WriteFiles(caCert, caKey); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote CA %s (key %s)\n", caCert, caKey)
	default:
		return fmt.Errorf("CA %s: %w", caCert, err)
	}

	roles, speaks := c.Roles(), c.SpeaksFor()
	if len(roles) == 0 {
		return errors.New("config: no role to issue a certificate for")
	}
	node := "spiffe://" + *trust + "/node/" + sanitize(host)
	opts := pki.LeafOptions{URIs: []string{node}, DNSNames: []string{"localhost"}, NotAfter: time.Now().Add(*validity)}
	hosts := []string{host}
	if c.Gateway != nil { // the API's clients check the gateway's host name
		if gh, _, err := net.SplitHostPort(c.Gateway.Listen); err == nil && gh != host {
			hosts = append(hosts, gh)
		}
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			opts.IPs = append(opts.IPs, ip)
		} else if h != "" && h != "localhost" {
			opts.DNSNames = append(opts.DNSNames, h)
		}
	}
	leaf, err := ca.Issue(opts)
	if err != nil {
		return err
	}
	if err := leaf.WriteFiles(c.TLS.Cert, c.TLS.Key); err != nil {
		return err
	}
	if c.TLS.ClientCert != c.TLS.Cert {
		if err := leaf.WriteFiles(c.TLS.ClientCert, c.TLS.ClientKey); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "wrote %s for %s (roles %v)\n", c.TLS.Cert, node, roles)

	toolID := "spiffe://" + *trust + "/client/tool"
	tool, err := ca.Issue(pki.LeafOptions{URIs: []string{toolID}, NotAfter: time.Now().Add(*validity)})
	if err != nil {
		return err
	}
	if err := tool.WriteFiles(filepath.Join(dir, "client.pem"), filepath.Join(dir, "client.key")); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s for %s (role client)\n", filepath.Join(dir, "client.pem"), toolID)

	var scopes []string
	for i, s := range c.Scopes {
		p := s.KeyFile
		data, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			k, err := kvsp.GenerateScopeKey()
			if err != nil {
				return err
			}
			if err := os.WriteFile(p, k.Export(), 0o600); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "wrote scope key %s (scope_id %s)\n", p, k.ID())
			scopes = append(scopes, k.ID().String())
			continue
		}
		if err != nil {
			return err
		}
		k, err := kvsp.ScopeKeyFromFile(data)
		if err != nil {
			return fmt.Errorf("config: scopes[%d].key_file: %w", i, err)
		}
		scopes = append(scopes, k.ID().String())
	}
	pf := policyOut{Principals: []policyPrincipal{
		{ID: node, Roles: roles, SpeaksFor: speaks, Scopes: nonNil(scopes)},
		{ID: toolID, Roles: []string{"client"}, Scopes: nonNil(scopes)},
	}}
	for _, name := range engines {
		// An engine outside kvsp (vLLM through kvsp.vllm): it stores the
		// blocks it computes (producer, S13) and looks up, leases and
		// reads (client), in every scope; it hosts no role.
		id := "spiffe://" + *trust + "/engine/" + name
		leaf, err := ca.Issue(pki.LeafOptions{URIs: []string{id}, NotAfter: time.Now().Add(*validity)})
		if err != nil {
			return err
		}
		if err := leaf.WriteFiles(filepath.Join(dir, name+".pem"), filepath.Join(dir, name+".key")); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s for %s (roles producer, client)\n", filepath.Join(dir, name+".pem"), id)
		pf.Principals = append(pf.Principals, policyPrincipal{ID: id, Roles: []string{"producer", "client"}, Scopes: nonNil(scopes)})
	}
	if *perRole {
		// One identity per role: what a deployment that gives each
		// component its own certificate sees, for tests of authorization
		// and of the API contract (api/openapi.yaml's x-kvsp-roles).
		for _, role := range []string{"controller", "index", "holder", "instance", "client", "producer"} {
			id := "spiffe://" + *trust + "/role/" + role
			leaf, err := ca.Issue(pki.LeafOptions{URIs: []string{id}, NotAfter: time.Now().Add(*validity)})
			if err != nil {
				return err
			}
			if err := leaf.WriteFiles(filepath.Join(dir, "role-"+role+".pem"), filepath.Join(dir, "role-"+role+".key")); err != nil {
				return err
			}
			var speaks []string
			switch role {
			case "holder":
				for _, h := range c.Holders {
					speaks = append(speaks, h.Base)
				}
			case "instance":
				for _, x := range c.Instances {
					speaks = append(speaks, x.Base)
				}
			}
			fmt.Fprintf(stdout, "wrote %s for %s (role %s)\n", filepath.Join(dir, "role-"+role+".pem"), id, role)
			pf.Principals = append(pf.Principals, policyPrincipal{ID: id, Roles: []string{role}, SpeaksFor: speaks, Scopes: nonNil(scopes)})
		}
	}
	if c.Gateway != nil && len(scopes) > 0 {
		// A development API key for the first scope, beside the
		// configuration; the policy holds its hash only.
		key, hash, err := newAPIKey()
		if err != nil {
			return err
		}
		kf := filepath.Join(dir, "api-key.txt")
		if err := os.WriteFile(kf, []byte(key+"\n"), 0o600); err != nil {
			return err
		}
		pf.APIKeys = []policyAPIKey{{SHA256: hash, Principal: "dev", Scope: scopes[0]}}
		fmt.Fprintf(stdout, "wrote API key %s (principal dev, scope %s)\n", kf, scopes[0])
	}
	var pol bytes.Buffer
	enc := yaml.NewEncoder(&pol)
	enc.SetIndent(2)
	if err := enc.Encode(pf); err != nil {
		return err
	}
	if err := os.WriteFile(c.Policy, pol.Bytes(), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote policy %s\n", c.Policy)
	return nil
}

// engineName is what kvsp certs --engine takes: a name for a file and a URI path segment.
var engineName = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func sanitize(host string) string {
	out := []byte(host)
	for i, c := range out {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '-') {
			out[i] = '-'
		}
	}
	if len(out) == 0 {
		return "node"
	}
	return string(out)
}
