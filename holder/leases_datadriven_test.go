package holder

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/kvsp/kvsp"
)

// TestLeaseTable runs testdata/leases, the lease table's specification
// (R-LS-5, R-LS-6, R-LS-10, R-SEC-11, R-SEC-12, S11) as a script, on
// synctest's clock (go test -run TestLeaseTable -rewrite rewrites the
// expected outputs after a deliberate change; read the diff). Commands:
//
//	quota octets=N max-ttl=D max-leases=N   a new, empty table
//	grant owner=O keys=K,K octets=N ttl=D as=NAME
//	renew owner=O lease=NAME ttl=D [revoked]   (revoked: O lost the scope)
//	release owner=O lease=NAME
//	advance D                               the clock moves on
//	pinned keys=K,K                         which keys a live lease covers
//	live                                    leases and octets not expired
func TestLeaseTable(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var (
			l   *leases
			ids = map[string]string{} // script name -> lease id
		)
		key := func(s string) blockID {
			n, err := strconv.Atoi(s)
			if err != nil {
				t.Fatalf("key %q", s)
			}
			return blockID{scope: kvsp.ScopeID{1}, key: kvsp.BlockKey{byte(n)}}
		}
		keys := func(d *datadriven.TestData) []blockID {
			var s string
			d.ScanArgs(t, "keys", &s)
			var out []blockID
			for _, k := range strings.Split(s, ",") {
				out = append(out, key(k))
			}
			return out
		}
		dur := func(d *datadriven.TestData, name string) time.Duration {
			var s string
			d.ScanArgs(t, name, &s)
			v, err := time.ParseDuration(s)
			if err != nil {
				t.Fatalf("%s=%q", name, s)
			}
			return v
		}
		outcome := func(err error) string {
			var p *kvsp.Problem
			switch {
			case err == nil:
				return "ok"
			case errors.As(err, &p):
				return fmt.Sprintf("%d %s: %s", p.Status, p.Type[strings.LastIndexByte(p.Type, '#')+1:], p.Detail)
			case errors.Is(err, kvsp.ErrNotFound):
				return "404 not found"
			}
			return "error: " + err.Error()
		}
		datadriven.RunTest(t, "testdata/leases", func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "quota":
				var q LeaseQuota
				var octets int64
				d.ScanArgs(t, "octets", &octets)
				d.ScanArgs(t, "max-leases", &q.MaxLeases)
				q.Octets, q.MaxTTL = octets, dur(d, "max-ttl")
				l, ids = newLeases(q), map[string]string{}
				return ""
			case "grant":
				var owner, as string
				var octets int64
				d.ScanArgs(t, "owner", &owner)
				d.ScanArgs(t, "octets", &octets)
				d.MaybeScanArgs(t, "as", &as)
				ls, err := l.grant(owner, keys(d), octets, dur(d, "ttl"))
				if err == nil && as != "" {
					ids[as] = ls.id
				}
				return outcome(err)
			case "renew":
				var owner, name string
				d.ScanArgs(t, "owner", &owner)
				d.ScanArgs(t, "lease", &name)
				revoked := d.HasArg("revoked")
				ls, err := l.renew(owner, ids[name], dur(d, "ttl"), func(kvsp.ScopeID) bool { return !revoked })
				if err == nil {
					return fmt.Sprintf("ok, expires in %v", time.Until(ls.expires))
				}
				return outcome(err)
			case "release":
				var owner, name string
				d.ScanArgs(t, "owner", &owner)
				d.ScanArgs(t, "lease", &name)
				return outcome(l.release(owner, ids[name]))
			case "advance":
				v, err := time.ParseDuration(strings.TrimSpace(d.CmdArgs[0].Key))
				if err != nil {
					t.Fatalf("advance %v", d.CmdArgs)
				}
				time.Sleep(v)
				return ""
			case "pinned":
				var b strings.Builder
				for _, k := range keys(d) {
					state := "free"
					if l.pinned(k) {
						state = "pinned"
					}
					fmt.Fprintf(&b, "%d: %s\n", k.key[0], state)
				}
				return b.String()
			case "live":
				n, octets := l.live(time.Now())
				return fmt.Sprintf("%d leases, %d octets", n, octets)
			}
			t.Fatalf("unknown command %q", d.Cmd)
			return ""
		})
	})
}
