package server_test

import (
	"net/http"
	"regexp"
	"strings"
	"testing"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/internal/kvsptest"
	"github.com/kvsp/kvsp/server"
)

// TestRequestLogLines: a request's lines, from the server (a refusal, the
// routine line at debug) and from its handler (server.Logger), name its
// request id, the one its problem carries, and its principal; made only
// when a line is written (requestLog), they still carry both.
func TestRequestLogLines(t *testing.T) {
	p := kvsptest.NewPKI(t)
	r := startRig(t, p, rigOptions{}, func(s *server.Server) {
		echoRoutes(s)
		s.Mount("/l/").Handle("GET", "refuse", server.Route{}, func(w http.ResponseWriter, req *http.Request) error {
			server.Logger(req.Context()).Info("handler line", "id_seen", server.RequestID(req.Context()))
			return kvsp.NewProblem(kvsp.ErrNotFound, "nothing here")
		})
	})
	c := kvsptest.HTTPClient(t, &http.Transport{TLSClientConfig: p.ClientTLS(p.Leaf(kvsptest.ClientA)), ForceAttemptHTTP2: true})
	mark := r.Log.Len()
	resp, body, err := get(c, "GET", r.URL("/l/refuse"), "", "")
	if err != nil || resp.StatusCode != http.StatusNotFound {
		t.Fatalf("refuse: %v %v", resp, err)
	}
	m := regexp.MustCompile(`"instance":"urn:kvsp:request:([0-9a-f]{16})"`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("problem without a request id: %s", body)
	}
	id := string(m[1])
	if !r.Log.WaitFor(mark, "msg=request", 2e9) {
		t.Fatalf("no request line: %s", r.Log.Since(mark))
	}
	var handler, refusal bool
	for _, line := range strings.Split(r.Log.Since(mark), "\n") {
		if !strings.Contains(line, "request_id="+id) {
			continue
		}
		if !strings.Contains(line, "principal="+kvsptest.ClientA) {
			t.Errorf("a line without the principal: %s", line)
		}
		handler = handler || strings.Contains(line, "handler line") && strings.Contains(line, "id_seen="+id)
		refusal = refusal || strings.Contains(line, "msg=request") && strings.Contains(line, "status=404")
	}
	if !handler || !refusal {
		t.Fatalf("request %s: handler line %v, refusal line %v in\n%s", id, handler, refusal, r.Log.Since(mark))
	}
	mark = r.Log.Len()
	if resp, _, err := get(c, "GET", r.URL("/t/any"), "", ""); err != nil || resp.StatusCode != 200 {
		t.Fatalf("any: %v %v", resp, err)
	}
	if !r.Log.WaitFor(mark, "status=200", 2e9) || !strings.Contains(r.Log.Since(mark), "principal="+kvsptest.ClientA) {
		t.Fatalf("routine line at debug: %s", r.Log.Since(mark))
	}
}
