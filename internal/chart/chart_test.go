package chart

import (
	"bytes"
	"image/color"
	"image/png"
	"math"
	"testing"
)

// TestDrawPlacesPoints: each series is drawn in its colour where its
// points fall (log2 x axis, y from 0 to a round top), and the PNG decodes.
func TestDrawPlacesPoints(t *testing.T) {
	c := &Chart{Title: "GET bandwidth", XLabel: "block size", YLabel: "MB/s", LogX: true,
		Series: []Series{
			{Name: "h2", Points: []Point{{256 << 10, 100}, {1 << 20, 300}, {16 << 20, 480}}},
			{Name: "quicbulk", Points: []Point{{256 << 10, 50}, {1 << 20, 200}, {16 << 20, 400}}},
		}}
	img, err := c.Draw()
	if err != nil {
		t.Fatal(err)
	}
	// Plot area 80..710 x 40..480; y top 500 (niceCeil of 480).
	at := func(x, y float64) color.RGBA {
		fx := (math.Log2(x) - 18) / (24 - 18)
		return img.RGBAAt(80+int(math.Round(fx*630)), 480-int(math.Round(y/500*440)))
	}
	if got := at(16<<20, 480); got != palette[0] {
		t.Errorf("h2's last point: %v, want %v", got, palette[0])
	}
	if got := at(1<<20, 200); got != palette[1] {
		t.Errorf("quicbulk's middle point: %v, want %v", got, palette[1])
	}
	var buf bytes.Buffer
	if err := c.WritePNG(&buf); err != nil {
		t.Fatal(err)
	}
	if _, err := png.Decode(&buf); err != nil {
		t.Fatal(err)
	}
}

// TestDrawRefuses: nothing to draw, NaN, and x <= 0 on a log axis are
// errors, not broken images.
func TestDrawRefuses(t *testing.T) {
	for name, c := range map[string]*Chart{
		"empty":    {},
		"nan":      {Series: []Series{{Points: []Point{{1, math.NaN()}}}}},
		"log zero": {LogX: true, Series: []Series{{Points: []Point{{0, 1}}}}},
	} {
		if _, err := c.Draw(); err == nil {
			t.Errorf("%s: drawn", name)
		}
	}
}

func TestDecimals(t *testing.T) {
	for step, want := range map[float64]int{100: 0, 1: 0, 0.2: 1, 0.05: 2, 0.001: 3} {
		if got := decimals(step); got != want {
			t.Errorf("decimals(%v) = %d, want %d", step, got, want)
		}
	}
}

func TestNiceCeil(t *testing.T) {
	for _, tc := range []struct{ v, top, step float64 }{
		{480, 500, 100}, {0.93, 1, 0.2}, {1234, 1500, 500}, {7, 8, 2}, {0, 1, 0.2},
	} {
		top, step := niceCeil(tc.v)
		if math.Abs(top-tc.top) > 1e-9 || math.Abs(step-tc.step) > 1e-9 {
			t.Errorf("niceCeil(%v) = %v, %v; want %v, %v", tc.v, top, step, tc.top, tc.step)
		}
	}
}
