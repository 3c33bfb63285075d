package kvsptest

import (
	"math"
	"math/rand/v2"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestKSTwoSample checks the statistic of the S9 rows itself: the tabulated critical
// values of the Kolmogorov distribution, identical samples, and a shift.
func TestKSTwoSample(t *testing.T) {
	for _, c := range []struct{ l, q float64 }{{1.0, 0.2700}, {1.36, 0.0494}, {1.63, 0.0098}, {0.5, 0.9639}} {
		if got := qKS(c.l); math.Abs(got-c.q) > 5e-4 {
			t.Errorf("Q_KS(%v) = %.4f, want %.4f", c.l, got, c.q)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	x, y := make([]float64, 1000), make([]float64, 1000)
	for i := range x {
		x[i], y[i] = rng.ExpFloat64(), rng.ExpFloat64()
	}
	if d, p := KSTwoSample(x, x); d != 0 || p != 1 {
		t.Errorf("identical samples: D %v p %v", d, p)
	}
	if _, p := KSTwoSample(x, y); p <= 0.01 {
		t.Errorf("two samples of one distribution: p %v", p)
	}
	for i := range y {
		y[i] += 0.2
	}
	if d, p := KSTwoSample(x, y); p >= 1e-6 || d < 0.1 {
		t.Errorf("a shift of 0.2 mean: D %v p %v, want p < 1e-6", d, p)
	}
}
