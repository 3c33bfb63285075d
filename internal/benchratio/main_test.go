package main

import (
	"strings"
	"testing"
)

// TestRatiosPairRuns: the k-th result of a peer is divided by the k-th of
// the reference, and the median, least and greatest ratios are printed.
func TestRatiosPairRuns(t *testing.T) {
	in := `goos: linux
BenchmarkVersusNginx/h2/clients=1/nginx-2    100  1 ns/op  400 MB/s  0.50 server-cpu-s/GB
BenchmarkVersusNginx/h2/clients=1/holder-2   100  1 ns/op  420 MB/s  0.40 server-cpu-s/GB
BenchmarkVersusNginx/h2/clients=1/nginx-2    100  1 ns/op  500 MB/s  0.50 server-cpu-s/GB
BenchmarkVersusNginx/h2/clients=1/holder-2   100  1 ns/op  400 MB/s  0.55 server-cpu-s/GB
BenchmarkVersusNginx/h2/clients=1/nginx-2    100  1 ns/op  400 MB/s  1.00 server-cpu-s/GB
BenchmarkVersusNginx/h2/clients=1/holder-2   100  1 ns/op  400 MB/s  0.45 server-cpu-s/GB
PASS
`
	var out strings.Builder
	if err := run(strings.NewReader(in), &out, "nginx"); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{
		"VersusNginx/h2/clients=1", "holder/nginx", "MB/s", "median 1.000  min 0.800  max 1.050  (3 runs)",
		"server-cpu-s/GB", "median 0.800  min 0.450  max 1.100  (3 runs)",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in\n%s", want, got)
		}
	}
	if err := run(strings.NewReader(in), &out, "apache"); err == nil {
		t.Error("no error for a reference that is not there")
	}
}
