package placement

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/kvsp/kvsp"
)

// TestInstanceLifecycle runs testdata/lifecycle, the PC's view of its
// instances as a script on synctest's clock: status records with their
// epochs and TTLs (R-ST-3, R-ST-4, R-ST-6, A-12) and the sleep an
// instance asks for (R-ST-8, R-ST-9, A-19). Commands:
//
//	status ii=NAME epoch=N state=S [model=a|b] [ttl=D] [asks=S]
//	    a status record; the answer is the state the PC sets, or the
//	    problem it answers
//	get ii=NAME    what the PC holds of the instance
//	advance D      the clock moves on
func TestInstanceLifecycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r := NewRegistry()
		uri := func(name string) string { return "https://" + name + ".example/kvsp/" }
		datadriven.RunTest(t, "testdata/lifecycle", func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "status":
				var name, state, model, ttl, asks string
				var epoch uint64
				d.ScanArgs(t, "ii", &name)
				d.ScanArgs(t, "epoch", &epoch)
				d.ScanArgs(t, "state", &state)
				d.MaybeScanArgs(t, "model", &model)
				d.MaybeScanArgs(t, "ttl", &ttl)
				d.MaybeScanArgs(t, "asks", &asks)
				compat := compatA
				if model == "b" {
					compat = compatB
				}
				st := status(uri(name), epoch, kvsp.InstanceState(state), compat)
				if ttl != "" {
					v, err := time.ParseDuration(ttl)
					if err != nil {
						t.Fatalf("ttl=%q", ttl)
					}
					st.TTLMs = uint64(v.Milliseconds())
				}
				if asks != "" {
					s := kvsp.InstanceState(asks)
					st.RequestedState = &s
				}
				s, err := r.Put(st)
				var p *kvsp.Problem
				switch {
				case err == nil:
					return string(s)
				case errors.As(err, &p):
					return fmt.Sprintf("%d %s (epoch %v)", p.Status, p.Type[strings.LastIndexByte(p.Type, '#')+1:], p.Extensions["epoch"])
				}
				return "error: " + err.Error()
			case "get":
				var name string
				d.ScanArgs(t, "ii", &name)
				g, ok := r.Get(uri(name))
				if !ok {
					return "unknown"
				}
				return fmt.Sprintf("%s, epoch %d", g.State, g.Status.Epoch)
			case "advance":
				v, err := time.ParseDuration(d.CmdArgs[0].Key)
				if err != nil {
					t.Fatalf("advance %v", d.CmdArgs)
				}
				time.Sleep(v)
				return ""
			}
			t.Fatalf("unknown command %q", d.Cmd)
			return ""
		})
	})
}
