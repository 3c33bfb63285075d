package instance

import (
	"testing"

	"github.com/kvsp/kvsp"
)

// TestResumeAtResends: a resumed stream starts at output_offset, or, when
// the front end says it lacks earlier indices (From), first resends those
// from the checkpoint, labelled with the new epoch.
func TestResumeAtResends(t *testing.T) {
	gen := []uint32{10, 11, 12, 13, 14}
	for _, c := range []struct {
		from *uint64
		want []uint64
	}{{nil, nil}, {ptr(5), nil}, {ptr(3), []uint64{3, 4}}, {ptr(0), []uint64{0, 1, 2, 3, 4}}} {
		var got []uint64
		cp := &checkpointer{q: &kvsp.GenerateRequest{Epoch: 2}, emit: func(tk kvsp.GeneratedToken) error {
			if tk.Epoch != 2 || tk.Token != gen[tk.Index] {
				t.Fatalf("resent %+v", tk)
			}
			got = append(got, tk.Index)
			return nil
		}}
		if err := cp.resumeAt(gen, c.from); err != nil {
			t.Fatal(err)
		}
		if len(got) != len(c.want) || cp.released != 5 || cp.sent != 5 {
			t.Fatalf("from %v: resent %v, released %d", c.from, got, cp.released)
		}
		for i := range got {
			if got[i] != c.want[i] {
				t.Fatalf("from %v: resent %v", c.from, got)
			}
		}
	}
}

func ptr(v uint64) *uint64 { return &v }
