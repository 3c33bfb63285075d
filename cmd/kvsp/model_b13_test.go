package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvsp/kvsp/internal/figures"
	"github.com/kvsp/kvsp/internal/gguf"
)

// withEntries is the tiny model m with extra KV entries (n of them, as
// encoded) inserted after its own, and its data section moved to stay
// aligned.
func withEntries(t *testing.T, m []byte, n int, extra []byte) []byte {
	t.Helper()
	f, err := gguf.Parse(bytes.NewReader(m), int64(len(m)))
	if err != nil {
		t.Fatal(err)
	}
	kvEnd := 24 + len(f.RawEntries(""))
	infosEnd := kvEnd
	for _, ti := range f.Tensors() {
		infosEnd += 8 + len(ti.Name) + 4 + 8*len(ti.Dims) + 4 + 8
	}
	out := make([]byte, 0, len(m)+len(extra)+gguf.WriterAlignment)
	out = append(out, m[:kvEnd]...)
	binary.LittleEndian.PutUint64(out[16:], binary.LittleEndian.Uint64(m[16:])+uint64(n))
	out = append(out, extra...)
	out = append(out, m[kvEnd:infosEnd]...)
	for len(out)%gguf.WriterAlignment != 0 {
		out = append(out, 0)
	}
	return append(out, m[f.DataOffset():]...)
}

// tinyKeys encodes n KV entries of 19 octets: a 6-octet key, uint8 0.
func tinyKeys(n int) []byte {
	b := make([]byte, 0, 19*n)
	for i := range n {
		b = binary.LittleEndian.AppendUint64(b, 6)
		b = fmt.Appendf(b, "%06x", i)
		b = binary.LittleEndian.AppendUint32(b, uint32(gguf.TypeUint8))
		b = append(b, 0)
	}
	return b
}

// descriptorRun runs kvsp model descriptor on path in a process of its
// own and returns its exit code, output and peak RSS (VmHWM, which the
// process prints last on its stderr).
func descriptorRun(t *testing.T, path string) (code int, out, errs string, peak int64, took time.Duration) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVSP_TEST_ARGS=model\x1fdescriptor\x1f"+path, "KVSP_TEST_PEAK=1")
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	start := time.Now()
	err := cmd.Run()
	took = time.Since(start)
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatal(err)
	}
	errs, line, _ := strings.Cut(e.String(), "VmHWM:")
	kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(line), "kB")), 10, 64)
	if err != nil {
		t.Fatalf("no peak RSS in %q", e.String())
	}
	return cmd.ProcessState.ExitCode(), o.String(), errs, kb << 10, took
}

// TestB13_GGUFMetadataAmplification (RELIABILITY B13), through kvsp model
// descriptor in a process of its own, against the tiny model's peak RSS:
//   - The red team's file, the tiny model with 2 million tiny keys (39
//     MB; D6: 4 million took 1.3 GiB and 11 s), is refused naming the cap,
//     with a peak RSS within 8 MiB of the tiny model's.
//   - A model at the key cap that also holds 2 million empty strings (18
//     MB) is described, with the tiny model's tokenizer digest, its peak
//     RSS at most 3 times the file above the tiny model's (measured: 1.0;
//     under the race detector, whose shadow memory counts too, 8 times:
//     measured 2.7).
func TestB13_GGUFMetadataAmplification(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the peak RSS is read from /proc/self/status")
	}
	var buf bytes.Buffer
	if err := gguf.WriteTinyLlama(&buf, gguf.DefaultTiny()); err != nil {
		t.Fatal(err)
	}
	tiny := buf.Bytes()
	dir := t.TempDir()
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const millions, strs = 2_000_000, 2 << 20
	tinyPath := write("tiny.gguf", tiny)
	d6 := write("d6.gguf", withEntries(t, tiny, millions, tinyKeys(millions)))
	own := 14 // WriteTinyLlama's keys
	arr := binary.LittleEndian.AppendUint64(nil, uint64(len("b13.strings")))
	arr = append(arr, "b13.strings"...)
	arr = binary.LittleEndian.AppendUint32(arr, uint32(gguf.TypeArray))
	arr = binary.LittleEndian.AppendUint32(arr, uint32(gguf.TypeString))
	arr = binary.LittleEndian.AppendUint64(arr, strs)
	arr = append(arr, make([]byte, 8*strs)...)
	atCaps := withEntries(t, tiny, gguf.MaxKeys-own, append(tinyKeys(gguf.MaxKeys-own-1), arr...))
	capsPath := write("caps.gguf", atCaps)

	code, out, errs, base, _ := descriptorRun(t, tinyPath)
	if code != 0 {
		t.Fatalf("the tiny model: code %d: %s", code, errs)
	}
	var want struct {
		TokenizerDigest string `json:"tokenizer_digest"`
	}
	if err := json.Unmarshal([]byte(out), &want); err != nil || want.TokenizerDigest == "" {
		t.Fatalf("the tiny model's descriptor %q: %v", out, err)
	}
	fi, _ := os.Stat(d6)
	code, _, errs, rss, took := descriptorRun(t, d6)
	t.Logf("%d tiny keys (%d octets): code %d in %v, peak RSS %d (the tiny model's %d): %s", millions, fi.Size(), code, took.Round(time.Millisecond), rss, base, strings.TrimSpace(errs))
	if wantErr := fmt.Sprintf("%d keys exceed the cap of %d at offset 16 reading header", millions+own, gguf.MaxKeys); code != 1 || !strings.Contains(errs, wantErr) {
		t.Errorf("%d tiny keys: code %d, %q; want 1 and %q", millions, code, errs, wantErr)
	}
	if rss > base+8<<20 {
		t.Errorf("%d tiny keys: peak RSS %d, the tiny model's %d", millions, rss, base)
	}
	d6RSS := rss

	mult := int64(3)
	if raceEnabled {
		mult = 8
	}
	code, out, errs, rss, took = descriptorRun(t, capsPath)
	ratio := float64(rss-base) / float64(len(atCaps))
	t.Logf("%d keys and %d empty strings (%d octets): code %d in %v, peak RSS %d, %.2f times the file above the tiny model's", gguf.MaxKeys, strs, len(atCaps), code, took.Round(time.Millisecond), rss, ratio)
	if code != 0 || !strings.Contains(out, `"tokenizer_digest":"`+want.TokenizerDigest+`"`) {
		t.Fatalf("the model at the caps: code %d %q %s", code, out, errs)
	}
	if rss-base > mult*int64(len(atCaps)) {
		t.Errorf("the model at the caps: peak RSS %d, the tiny model's %d, for %d octets: more than %d times", rss, base, len(atCaps), mult)
	}
	figures.Report(t, figures.Row{Row: "B13", Inputs: 2,
		Held:   fmt.Sprintf("kvsp model descriptor: %d tiny keys refused at the cap with a peak RSS of %d KiB (the tiny model's %d KiB); a model at the caps described with %.2f times its size in RSS above the tiny model's", millions, d6RSS>>10, base>>10, ratio),
		Detail: map[string]float64{"base_rss": float64(base), "d6_rss": float64(d6RSS), "caps_rss": float64(rss), "caps_octets": float64(len(atCaps)), "caps_rss_ratio": ratio}})
}
