package h2

import (
	"net/http"
	"time"
)

// Handlers run on worker goroutines that outlive them, one connection's
// at a time. A new goroutine starts with a small stack and grows it, a
// copy each time, as its calls deepen: a handler as deep as the holder's
// GET (routing, authorization, the store) paid for that on every request
// (runtime.newstack was 0.9% of the holder's CPU at 8 streams of 2 MiB
// blocks, about 9 µs a request). A worker keeps the stack it grew, as
// net/http's HTTP/1.1 server does by serving a connection's requests on
// one goroutine.

// maxIdleWorkers is how many workers a connection keeps waiting for a
// handler; a worker past it ends with its handler. A worker idle for
// workerIdle ends too: a burst's workers do not outlive it by more, while
// a connection under steady load keeps its own.
const (
	maxIdleWorkers = 16
	workerIdle     = time.Second
)

type handlerJob struct {
	st  *stream
	req *http.Request
}

// goHandler runs st's handler on an idle worker, or on a new one.
func (c *conn) goHandler(st *stream, req *http.Request) {
	select {
	case c.work <- handlerJob{st, req}:
	default:
		go c.worker(handlerJob{st, req})
	}
}

// worker runs handlers until the connection ends, until it finds
// maxIdleWorkers others waiting, or until it has waited workerIdle.
func (c *conn) worker(j handlerJob) {
	var idle *time.Timer
	defer func() {
		if idle != nil {
			idle.Stop()
		}
	}()
	for {
		c.runHandler(j.st, j.req)
		j = handlerJob{}
		if c.idleWorkers.Add(1) > maxIdleWorkers {
			c.idleWorkers.Add(-1)
			return
		}
		if idle == nil {
			idle = time.NewTimer(workerIdle)
		} else {
			idle.Reset(workerIdle)
		}
		select {
		case j = <-c.work:
			c.idleWorkers.Add(-1)
		case <-c.done:
			c.idleWorkers.Add(-1)
			return
		case <-idle.C:
			c.idleWorkers.Add(-1)
			return
		}
	}
}
