package instance

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvsp/kvsp"
)

// TestLinksMeasured (issue 47: the cost model's inputs are what the
// instance measures now): a holder's round trip is what the directives
// measured from their receipt to its first layer; its rate is the octets after first layers over the time
// some GET from it streamed, GETs in parallel sharing it; a measured link
// replaces the configured one, and fades back to it as the measurements
// age.
func TestLinksMeasured(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const h1, h2 = "https://h1.test/kvsp/", "https://h2.test/kvsp/"
		conf := []kvsp.Link{{Holder: h1, MbitPerS: 100000, RTTUs: 50}}
		l := newLinks(conf, time.Now)
		if got := l.report(); len(got) != 1 || got[0] != conf[0] {
			t.Fatalf("nothing measured: %+v, want the configured link", got)
		}
		// Two GETs from h1, 2 ms to their first layers, streaming in
		// parallel: 1 MB each over 10 ms (one interval of 10 ms):
		// 1,600 Mbit/s together, not 800 each.
		l.roundTrip(h1, 2*time.Millisecond)
		end1 := l.streaming(h1)
		end2 := l.streaming(h1)
		time.Sleep(10 * time.Millisecond)
		end1(1_000_000)
		end2(1_000_000)
		got := l.report()
		if len(got) != 1 || got[0].Holder != h1 || got[0].RTTUs != 2000 || got[0].MbitPerS != 1600 {
			t.Fatalf("measured %+v, want h1 at 2000 µs and 1600 Mbit/s", got)
		}
		// h2, not configured, is reported once measured.
		l.roundTrip(h2, time.Millisecond)
		end := l.streaming(h2)
		time.Sleep(4 * time.Millisecond)
		end(500_000)
		got = l.report()
		if len(got) != 2 || got[1].Holder != h2 || got[1].RTTUs != 1000 || got[1].MbitPerS != 1000 {
			t.Fatalf("measured %+v, want h2 at 1000 µs and 1000 Mbit/s too", got)
		}
		// Unmeasured for two minutes (twelve half-lives, one sample:
		// weight 4/4096), h1 is nearly as configured again; h2, with
		// nothing configured, stays as measured.
		time.Sleep(2 * time.Minute)
		got = l.report()
		if got[0].RTTUs > 60 || got[0].MbitPerS < 99000 || got[1].RTTUs != 1000 || got[1].MbitPerS != 1000 {
			t.Fatalf("two minutes later %+v: want h1 back near its configured link, h2 as measured", got)
		}
	})
}
