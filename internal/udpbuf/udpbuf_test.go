package udpbuf

import (
	"strings"
	"testing"
)

// TestListenReports: the report holds what the kernel granted (never 0 on
// a socket that exists) and says when it capped the request.
func TestListenReports(t *testing.T) {
	c, r, err := Listen("127.0.0.1:0", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if r.Want != DefaultSize || r.Receive <= 0 || r.Send <= 0 {
		t.Fatalf("report %+v", r)
	}
	t.Log(r)
	small, err := Tune(c, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	if small.Capped() || strings.Contains(small.String(), "capped") {
		t.Fatalf("64 KiB reported capped: %v", small)
	}
}

// TestReportCapped: a grant below the request is reported with the sysctl
// to raise.
func TestReportCapped(t *testing.T) {
	r := Report{Want: 8 << 20, Receive: 416 << 10, Send: 8 << 20}
	if !r.Capped() || !strings.Contains(r.String(), "net.core.rmem_max") || !strings.Contains(r.String(), "receive 416 KiB") {
		t.Fatalf("%v", r)
	}
}
