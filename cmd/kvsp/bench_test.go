package main

import (
	"path/filepath"
	"strings"
	"testing"
)

// TestBench: kvsp bench starts its holder, measures every point it was
// asked for with verified GETs (no errors, octets moved), prints the
// table, and writes a JSON report and a PNG chart that decode.
func TestBench(t *testing.T) {
	dir := t.TempDir()
	jsonPath, pngPath := filepath.Join(dir, "b.json"), filepath.Join(dir, "b.png")
	code, out, errs := runCLI(t, "bench", "-duration", "150ms", "-sizes", "256KiB,1MiB", "-streams", "1,3", "-layers", "all,2-5",
		"-transports", "h2,h3,h3-stock,quicbulk", "-json", jsonPath, "-png", pngPath)
	if code != 0 {
		t.Fatalf("bench: %d\n%s\n%s", code, out, errs)
	}
	var rep benchReport
	readReport(t, jsonPath, &rep)
	if len(rep.Results) != 4*2*2*2 {
		t.Fatalf("%d results, want 32", len(rep.Results))
	}
	for _, r := range rep.Results {
		want := int64(r.GETs) * int64(r.BlockOctets)
		if r.Layers == "2-5" {
			want /= 8 // 4 of 32 layers
		}
		if r.Errors != 0 || r.GETs == 0 || r.Octets != want || r.GBPerS <= 0 || r.FirstLayerP50Us <= 0 {
			t.Errorf("%+v", r)
		}
	}
	if rep.BoundSHA256 <= 0 || !strings.Contains(rep.UDPBuffers, "UDP socket buffers") {
		t.Errorf("bound %v, buffers %q", rep.BoundSHA256, rep.UDPBuffers)
	}
	if rep.BoundQUIC <= 0 || rep.BoundQUICVerified <= 0 {
		t.Errorf("QUIC bound %v, verified %v", rep.BoundQUIC, rep.BoundQUICVerified)
	}
	for _, want := range []string{"quicbulk", "h3-stock", "1MiB", "2-5", "bound: SHA-256", "bound: QUIC alone"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if b := decodePNG(t, pngPath).Bounds(); b.Dx() < 600 || b.Dy() < 400 {
		t.Fatalf("chart of %v", b)
	}
}

// TestBenchRDMAWithoutDevice: the rdma transport needs a verbs device;
// without one (or without -tags rdma) bench says why before measuring.
func TestBenchRDMAWithoutDevice(t *testing.T) {
	code, _, errs := runCLI(t, "bench", "-transports", "rdma", "-json", "", "-png", "")
	if code != 1 || !strings.Contains(errs, "the rdma transport: rdma: ") {
		t.Fatalf("exit %d, %q", code, errs)
	}
}

// TestBenchUsage: bad flags are usage errors (exit 2) naming the flag.
func TestBenchUsage(t *testing.T) {
	for _, args := range [][]string{
		{"-transports", "carrier-pigeon"},
		{"-sizes", "100KiB"},
		{"-streams", "0"},
		{"-layers", "5-2"},
		{"-holder", "https://h/"},
	} {
		code, _, errs := runCLI(t, append([]string{"bench"}, args...)...)
		if code != 2 || !strings.Contains(errs, "bench: ") {
			t.Errorf("%v: exit %d, %q", args, code, errs)
		}
	}
}

// TestBenchRunningHolder: --holder measures a kvsp serve process with the
// identity and scope of a configuration and a descriptor it stores, over
// HTTP/2 and the quicbulk path it serves.
func TestBenchRunningHolder(t *testing.T) {
	dir := t.TempDir()
	cfg := writeFile(t, dir, "kvsp.yaml", testConfig)
	writeFile(t, dir, "descriptor.json", appendixDescriptor)
	addr := serveCerts(t, cfg)
	jsonPath := filepath.Join(dir, "b.json")
	code, out, errs := runCLI(t, "bench", "-holder", "https://"+addr+"/h1/", "-config", cfg, "-descriptor", filepath.Join(dir, "descriptor.json"),
		"-transports", "h2,quicbulk", "-streams", "2", "-layers", "all", "-duration", "150ms", "-json", jsonPath, "-png", "")
	if code != 0 {
		t.Fatalf("bench: %d\n%s\n%s", code, out, errs)
	}
	var rep benchReport
	readReport(t, jsonPath, &rep)
	if len(rep.Results) != 2 {
		t.Fatalf("%d results", len(rep.Results))
	}
	for _, r := range rep.Results {
		if r.Errors != 0 || r.GETs == 0 || r.BlockOctets != 512<<10 {
			t.Errorf("%+v", r)
		}
	}
}
