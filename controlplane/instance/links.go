package instance

import (
	"math"
	"slices"
	"sync"
	"time"

	"github.com/kvsp/kvsp"
)

// linkHalfLife is how fast a link's measurements age: a sample counts half
// as much after it. A link not measured for a few half-lives is reported
// as configured again (or, with no configured link, as last measured), so
// an estimate taken in a burst does not keep the PC from fetching once the
// burst is over (it fetches nothing more over a link it believes slow,
// and would never learn otherwise).
const linkHalfLife = 10 * time.Second

// links measures the instance's links to holders from its own transfers
// (issue 47: the cost model's inputs are what the instance measures now,
// not what a configuration said of an idle machine). Per holder:
//   - the round trip: the time from a directive's receipt to the first
//     layer from the holder (roundTrip says what it holds), averaged over
//     recent directives;
//   - the rate: the octets after each GET's first layer over the time at
//     least one GET from that holder was streaming. Transfers in
//     parallel share it, so this is the holder's aggregate rate as the
//     PC's estimate uses it (rtt + octets/rate per holder), not one
//     stream's.
//
// Both are time-weighted (linkHalfLife). A busy machine is slower at
// both, and that is what the estimate should see.
type links struct {
	mu   sync.Mutex
	conf []kvsp.Link
	m    map[string]*linkMeter
	now  func() time.Time
}

type linkMeter struct {
	at        time.Time // when the sums were last aged
	rttSum, n float64   // aged sum of round trips (µs) and of their count
	bits, us  float64   // aged octets*8 after first layers, and streaming µs
	streaming int       // GETs between their first layer and their end
	pend      float64   // their octets*8 so far
	since     time.Time // start of the current streaming interval
}

func newLinks(conf []kvsp.Link, now func() time.Time) *links {
	return &links{conf: conf, m: map[string]*linkMeter{}, now: now}
}

// age decays m's sums to now.
func (m *linkMeter) age(now time.Time) {
	if dt := now.Sub(m.at); dt > 0 && !m.at.IsZero() {
		f := math.Exp2(-float64(dt) / float64(linkHalfLife))
		m.rttSum, m.n, m.bits, m.us = m.rttSum*f, m.n*f, m.bits*f, m.us*f
	}
	m.at = now
}

func (l *links) meter(holder string, now time.Time) *linkMeter {
	m := l.m[holder]
	if m == nil {
		m = &linkMeter{at: now}
		l.m[holder] = m
	}
	m.age(now)
	return m
}

// roundTrip adds a round-trip sample for holder: the time from a
// directive's receipt to the first layer from that holder (its lease, the
// IS's digests, a transfer slot, the GET's request and the first octets:
// what a directive pays before its bulk, once per holder, as the PC's
// estimate counts it), or, for a holder that sent nothing before the
// directive's deadline, the time to the deadline (a lower bound: the
// estimate grows until the deadline it gives covers the holder).
func (l *links) roundTrip(holder string, d time.Duration) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	m := l.meter(holder, now)
	m.rttSum += float64(d.Microseconds())
	m.n++
}

// streaming records that a GET from holder streams from now on (its first
// layer came); it returns the function to call when the GET ends with the
// octets it moved after that layer.
func (l *links) streaming(holder string) func(octets uint64) {
	now := l.now()
	l.mu.Lock()
	m := l.meter(holder, now)
	if m.streaming == 0 {
		m.since = now
	}
	m.streaming++
	l.mu.Unlock()
	return func(octets uint64) {
		now := l.now()
		l.mu.Lock()
		defer l.mu.Unlock()
		m := l.meter(holder, now)
		m.pend += 8 * float64(octets)
		m.streaming--
		if m.streaming > 0 {
			return
		}
		// An interval under 100 µs says nothing of a rate the clock
		// can trust: its octets are not counted.
		if us := float64(now.Sub(m.since).Microseconds()); us >= 100 {
			m.bits, m.us = m.bits+m.pend, m.us+us
		}
		m.pend = 0
	}
}

// report is the status record's links: measured where measured, the
// configured ones fading in as measurements age (the measured weight: four
// times the aged count of round trips, up to one).
func (l *links) report() []kvsp.Link {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]kvsp.Link, 0, max(len(l.conf), len(l.m)))
	seen := make(map[string]bool, len(l.conf))
	for _, c := range l.conf {
		seen[c.Holder] = true
		m := l.m[c.Holder]
		if m == nil {
			out = append(out, c)
			continue
		}
		m.age(now)
		w := min(1, 4*m.n) // a sample counts whole for two half-lives, then fades
		rtt, mbit := m.measured(float64(c.RTTUs), float64(c.MbitPerS))
		out = append(out, kvsp.Link{Holder: c.Holder,
			RTTUs:    uint64(math.Round(w*rtt + (1-w)*float64(c.RTTUs))),
			MbitPerS: uint64(max(1, math.Round(w*mbit+(1-w)*float64(c.MbitPerS))))})
	}
	for h, m := range l.m {
		if seen[h] || m.n == 0 {
			continue
		}
		m.age(now)
		rtt, mbit := m.measured(0, 0)
		if mbit == 0 {
			continue // no rate measured yet: no link to report
		}
		out = append(out, kvsp.Link{Holder: h, RTTUs: uint64(math.Round(rtt)), MbitPerS: uint64(max(1, math.Round(mbit)))})
	}
	slices.SortStableFunc(out[len(l.conf):], func(a, b kvsp.Link) int {
		if a.Holder < b.Holder {
			return -1
		}
		if a.Holder > b.Holder {
			return 1
		}
		return 0
	})
	return out
}

// measured returns the round trip (µs) and rate (Mbit/s) measured, each
// falling back to rtt0 or mbit0 while not measured.
func (m *linkMeter) measured(rtt0, mbit0 float64) (rtt, mbit float64) {
	rtt, mbit = rtt0, mbit0
	if m.n > 0 {
		rtt = m.rttSum / m.n
	}
	if m.us > 0 && m.bits > 0 {
		mbit = m.bits / m.us // bits per µs = Mbit/s
	}
	return rtt, mbit
}
