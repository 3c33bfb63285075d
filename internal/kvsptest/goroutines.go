package kvsptest

import (
	"runtime"
	"time"
)

// QuietGoroutines returns the process's goroutine count once it has not
// changed for 50 ms (at most 2 s): what closing connections set going
// has ended. A leak check's baseline.
func QuietGoroutines() int {
	n := runtime.NumGoroutine()
	for end, still := time.Now().Add(2*time.Second), 0; still < 5 && time.Now().Before(end); {
		time.Sleep(10 * time.Millisecond)
		if m := runtime.NumGoroutine(); m != n {
			n, still = m, 0
		} else {
			still++
		}
	}
	return n
}

// SettleGoroutines waits, at most d, until the process has at most limit
// goroutines (idle HTTP/2 handler workers end a second after their last
// stream), and returns the last count.
func SettleGoroutines(limit int, d time.Duration) int {
	n := runtime.NumGoroutine()
	for end := time.Now().Add(d); n > limit && time.Now().Before(end); n = runtime.NumGoroutine() {
		time.Sleep(10 * time.Millisecond)
	}
	return n
}
