package kvsptest

import (
	"math"
	"slices"
)

// KSTwoSample is the two-sample Kolmogorov-Smirnov test: the statistic D
// (the largest distance between the empirical distribution functions) and
// its asymptotic p-value Q_KS((sqrt(ne) + 0.12 + 0.11/sqrt(ne)) D),
// ne = n1 n2 / (n1 + n2) (Numerical Recipes, 3rd ed., 14.3.3).
func KSTwoSample(a, b []float64) (d, p float64) {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	n1, n2 := float64(len(a)), float64(len(b))
	for i, j := 0, 0; i < len(a) && j < len(b); {
		x, y := a[i], b[j]
		if x <= y {
			i++
		}
		if y <= x {
			j++
		}
		d = max(d, math.Abs(float64(i)/n1-float64(j)/n2))
	}
	en := math.Sqrt(n1 * n2 / (n1 + n2))
	return d, qKS((en + 0.12 + 0.11/en) * d)
}

// qKS is the Kolmogorov distribution's complement,
// 2 sum_{j>=1} (-1)^(j-1) exp(-2 j^2 l^2).
func qKS(l float64) float64 {
	if l < 0.2 {
		return 1 // the series converges slowly there; the value is 1 to 1e-9
	}
	a2 := -2 * l * l
	sum, fac, prev := 0.0, 2.0, 0.0
	for j := 1; j <= 100; j++ {
		term := fac * math.Exp(a2*float64(j*j))
		sum += term
		if math.Abs(term) <= 1e-3*prev || math.Abs(term) <= 1e-10*sum {
			return min(max(sum, 0), 1)
		}
		fac = -fac
		prev = math.Abs(term)
	}
	return 1
}
