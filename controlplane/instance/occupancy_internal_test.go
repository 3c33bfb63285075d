package instance

import (
	"testing"
	"time"
)

// TestOccupancyIntegratesTheBatch: slot-time counts the requests up to
// the batch for as long as they are there, and the requests beyond it as
// waiting; nothing is counted before the first change.
func TestOccupancyIntegratesTheBatch(t *testing.T) {
	t0 := time.Unix(1000, 0)
	o := occupancy{batch: 2}
	// Each change gives the requests there were since the last one.
	o.change(5, t0)                    // the first: nothing before it is counted
	o.change(0, t0.Add(time.Second))   // 1 s idle
	o.change(1, t0.Add(3*time.Second)) // 2 s with one running
	o.change(3, t0.Add(4*time.Second)) // 1 s with three: two running, one waiting
	if o.busy != 4*time.Second || o.queued != time.Second {
		t.Fatalf("busy %v, queued %v: want 4s and 1s", o.busy, o.queued)
	}
}
