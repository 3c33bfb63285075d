//go:build race

package main

// raceEnabled: this test binary, and so a kvsp process it starts as
// itself, runs under the race detector, whose shadow memory adds to RSS.
const raceEnabled = true
