package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStatusPage: the PC's status page on metrics_listen shows its
// instances with state and epoch, and its sessions, and never a scope
// key or a token; headless Chromium renders it (a screenshot with ink on
// it). Chromium comes from Debian (make deps installs it); without it
// the rendering half is skipped unless KVSP_REQUIRE_CHROMIUM is set.
func TestStatusPage(t *testing.T) {
	dir, addr, maddr := demoDeployment(t, &demoConfig{instances: 2, holders: 1, hostCap: 64 << 20, prefillRate: 42000, decodeRate: 3100, transport: "h2"})
	front, scope, compat, err := demoFront(dir, demoDescriptor)
	if err != nil {
		t.Fatal(err)
	}
	defer front.Close()
	rp := &replayer{c: front, ctl: front.Controller("https://" + addr + "/pc/"), scope: scope, compat: compat, speed: 1, maxOutput: 2}
	q := traceRequest{InputLength: 700, OutputLength: 2, HashIDs: []int64{1, 2}}
	var r replayResult
	for deadline := time.Now().Add(10 * time.Second); ; { // until the instances have reported
		if r = rp.one(context.Background(), &q, time.Now()); r.err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	url := "http://" + maddr + "/"
	var page []byte
	var resp *http.Response
	for deadline := time.Now().Add(10 * time.Second); ; { // both instances' first status records
		if resp, err = http.Get(url); err != nil {
			t.Fatal(err)
		}
		page, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Count(string(page), `class="active"`) == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") || resp.Header.Get("Cache-Control") != "no-store" {
		t.Fatalf("status page: %d %v", resp.StatusCode, resp.Header)
	}
	// Each instance's engine kind, model and rates (issue 21).
	for _, want := range []string{"https://" + addr + "/ii1/", "https://" + addr + "/ii2/", `class="active"`, "Sessions (1)", "prefix hit ratio",
		"<td>sim</td><td>kvsp-demo/tiny-2l</td>", "<td>42000</td><td>3100</td>"} {
		if !strings.Contains(string(page), want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	key, _ := os.ReadFile(filepath.Join(dir, "scope-a.key"))
	if k := strings.TrimSpace(string(key)); k == "" || strings.Contains(string(page), k) {
		t.Fatal("the scope key is on the page")
	}
	if strings.Contains(string(page), scope.String()) {
		t.Fatal("a scope id is on the page")
	}
	chromium, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("KVSP_REQUIRE_CHROMIUM") != "" {
			t.Fatal("chromium is required (KVSP_REQUIRE_CHROMIUM) and not installed")
		}
		t.Skip("chromium not installed: the page was checked, not rendered")
	}
	shot := filepath.Join(dir, "status.png")
	cctx, ccancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer ccancel()
	cmd := exec.CommandContext(cctx, chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
		"--user-data-dir="+filepath.Join(dir, "chromium"), "--window-size=1200,800", "--screenshot="+shot, url)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("chromium: %v\n%s", err, out)
	}
	img := decodePNG(t, shot)
	ink := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y += 4 {
		for x := b.Min.X; x < b.Max.X; x += 4 {
			if r, g, bl, _ := img.At(x, y).RGBA(); r < 0x8000 && g < 0x8000 && bl < 0x8000 {
				ink++
			}
		}
	}
	if b.Dx() != 1200 || ink < 200 {
		t.Fatalf("screenshot %v with %d dark samples: not the page", b, ink)
	}
	t.Logf("screenshot: %v, %d dark samples", b, ink)
	if keep := os.Getenv("KVSP_STATUS_SHOT"); keep != "" { // to look at it
		data, _ := os.ReadFile(shot)
		os.WriteFile(keep, data, 0o644)
	}
}
