//go:build linux

package sockio

// RaceBuild tells the tests that Conn's calls go through entersyscall
// (raw_race.go).
const RaceBuild = raceBuild
