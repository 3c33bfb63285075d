// Command benchratio reads `go test -bench` output whose benchmarks end
// in a peer's name (BenchmarkVersusNginx/h2/clients=8/nginx,
// .../holder) and prints, for each row and each peer, the ratio of every
// metric to the reference peer's measured in the same run: the k-th
// result of a benchmark is paired with the k-th of its reference, so
// with -count N each ratio is over N runs in which the peers alternated.
// It reports the median, the least and the greatest ratio.
//
//	go test -run '^$' -bench VersusNginx -count 5 ./holder/ | go run ./internal/benchratio -ref nginx
package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

func main() {
	ref := flag.String("ref", "nginx", "the reference peer: the last element of its benchmarks' names")
	flag.Parse()
	if err := run(os.Stdin, os.Stdout, *ref); err != nil {
		fmt.Fprintln(os.Stderr, "benchratio:", err)
		os.Exit(1)
	}
}

// result is one benchmark line's metrics, by unit.
type result map[string]float64

var line = regexp.MustCompile(`^(Benchmark\S+?)(-\d+)?\s+\d+\s+(.*)$`)

func parse(r io.Reader) (map[string][]result, []string, error) {
	runs := map[string][]result{}
	var order []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		m := line.FindStringSubmatch(strings.TrimSpace(sc.Text()))
		if m == nil {
			continue
		}
		f := strings.Fields(m[3])
		res := result{}
		for i := 0; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			res[f[i+1]] = v
		}
		if runs[m[1]] == nil {
			order = append(order, m[1])
		}
		runs[m[1]] = append(runs[m[1]], res)
	}
	return runs, order, sc.Err()
}

func run(in io.Reader, out io.Writer, ref string) error {
	runs, order, err := parse(in)
	if err != nil {
		return err
	}
	found := false
	for _, name := range order {
		i := strings.LastIndexByte(name, '/')
		if i < 0 || name[i+1:] == ref {
			continue
		}
		row, peer := name[:i], name[i+1:]
		base := runs[row+"/"+ref]
		if base == nil {
			continue
		}
		found = true
		mine := runs[name]
		var units []string
		for u := range mine[0] {
			if u != "ns/op" && u != "B/op" && u != "allocs/op" {
				units = append(units, u)
			}
		}
		slices.Sort(units)
		for _, u := range units {
			var ratios []float64
			for k := 0; k < min(len(mine), len(base)); k++ {
				if b := base[k][u]; b != 0 {
					ratios = append(ratios, mine[k][u]/b)
				}
			}
			if len(ratios) == 0 {
				continue
			}
			s := slices.Clone(ratios)
			slices.Sort(s)
			med := s[len(s)/2]
			if len(s)%2 == 0 {
				med = (s[len(s)/2-1] + s[len(s)/2]) / 2
			}
			fmt.Fprintf(out, "%-48s %-16s %-22s median %.3f  min %.3f  max %.3f  (%d runs)\n",
				strings.TrimPrefix(row, "Benchmark"), peer+"/"+ref, u, med, s[0], s[len(s)-1], len(s))
		}
	}
	if !found {
		return fmt.Errorf("no benchmark has a %q peer beside it", ref)
	}
	return nil
}
