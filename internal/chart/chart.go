// Package chart draws line charts as PNG images, for the reports of kvsp
// bench and kvsp demo: one line per series, a linear or logarithmic x
// axis, gridlines with tick labels, a title and a legend. It draws with
// the standard image packages and x/image's fixed 7x13 font, so reports
// need no plotting stack.
package chart

import (
	"errors"
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"os"
	"strconv"

	"golang.org/x/image/font"
	"golang.org/x/image/font/basicfont"
	"golang.org/x/image/math/fixed"
)

// Point is one (x, y) observation.
type Point struct{ X, Y float64 }

// Series is one line.
type Series struct {
	Name   string
	Points []Point // in ascending X
}

// Chart is a line chart.
type Chart struct {
	Title          string
	XLabel, YLabel string
	// LogX draws the x axis in powers of two (block sizes); X must be > 0.
	LogX bool
	// XTick formats an x tick (default: %g).
	XTick func(float64) string
	// Width and Height in pixels; default 900x540.
	Width, Height int
	Series        []Series
}

// palette: distinguishable on white, in the order series are given.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xff, 0x7f, 0x0e, 0xff},
	{0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
}

var (
	black = color.RGBA{0x20, 0x20, 0x20, 0xff}
	grid  = color.RGBA{0xe4, 0xe4, 0xe4, 0xff}
)

// WritePNG draws the chart to w.
func (c *Chart) WritePNG(w io.Writer) error {
	img, err := c.Draw()
	if err != nil {
		return err
	}
	return png.Encode(w, img)
}

// WritePNGFile draws the chart into a new file at path.
func (c *Chart) WritePNGFile(path string) error { return WritePanelsPNGFile(path, c) }

// Draw renders the chart.
func (c *Chart) Draw() (*image.RGBA, error) {
	wd, ht := c.Width, c.Height
	if wd == 0 {
		wd = 900
	}
	if ht == 0 {
		ht = 540
	}
	xmin, xmax, ymax := math.Inf(1), math.Inf(-1), 0.0
	n := 0
	for _, s := range c.Series {
		for _, p := range s.Points {
			if math.IsNaN(p.X) || math.IsNaN(p.Y) || math.IsInf(p.Y, 0) || (c.LogX && p.X <= 0) {
				return nil, fmt.Errorf("chart: series %q: point (%v, %v) cannot be drawn", s.Name, p.X, p.Y)
			}
			xmin, xmax, ymax = min(xmin, p.X), max(xmax, p.X), max(ymax, p.Y)
			n++
		}
	}
	if n == 0 {
		return nil, errors.New("chart: no points")
	}
	fx := func(x float64) float64 { return x }
	if c.LogX {
		fx = math.Log2
	}
	lo, hi := fx(xmin), fx(xmax)
	if hi == lo {
		lo, hi = lo-1, hi+1
	}
	ytop, ystep := niceCeil(ymax)
	img := image.NewRGBA(image.Rect(0, 0, wd, ht))
	draw.Draw(img, img.Bounds(), image.White, image.Point{}, draw.Src)
	// Plot area.
	left, right, top, bottom := 80, wd-190, 40, ht-60
	px := func(x float64) int { return left + int(math.Round((fx(x)-lo)/(hi-lo)*float64(right-left))) }
	py := func(y float64) int { return bottom - int(math.Round(y/ytop*float64(bottom-top))) }
	// Horizontal gridlines and y ticks.
	for y := 0.0; y <= ytop+ystep/2; y += ystep {
		hline(img, left, right, py(y), grid)
		s := strconv.FormatFloat(y, 'f', decimals(ystep), 64)
		text(img, left-8-7*len(s), py(y)+4, s, black)
	}
	// Vertical gridlines and x ticks at the data's x values.
	xs := map[float64]bool{}
	for _, s := range c.Series {
		for _, p := range s.Points {
			xs[p.X] = true
		}
	}
	tick := c.XTick
	if tick == nil {
		tick = func(x float64) string { return strconv.FormatFloat(x, 'g', 4, 64) }
	}
	ticks := make([]float64, 0, len(xs))
	for x := range xs {
		ticks = append(ticks, x)
	}
	if len(ticks) > 12 { // dense data (a time series): round steps instead
		ticks = ticks[:0]
		if c.LogX {
			for e := math.Ceil(lo); e <= hi; e++ {
				ticks = append(ticks, math.Exp2(e))
			}
		} else {
			_, step := niceCeil(xmax - xmin)
			for x := math.Ceil(xmin/step) * step; x <= xmax; x += step {
				ticks = append(ticks, x)
			}
		}
	}
	for _, x := range ticks {
		vline(img, px(x), top, bottom, grid)
		s := tick(x)
		text(img, px(x)-7*len(s)/2, bottom+18, s, black)
	}
	// Axes.
	hline(img, left, right, bottom, black)
	vline(img, left, top, bottom, black)
	text(img, left, 24, c.Title, black)
	text(img, (left+right)/2-7*len(c.XLabel)/2, ht-16, c.XLabel, black)
	text(img, 8, top-10, c.YLabel, black)
	// Lines, points and legend.
	for i, s := range c.Series {
		col := palette[i%len(palette)]
		r := 3
		if len(s.Points) > 30 { // a dense series is its line
			r = 1
		}
		for j, p := range s.Points {
			x, y := px(p.X), py(p.Y)
			square(img, x, y, r, col)
			if j > 0 {
				q := s.Points[j-1]
				line(img, px(q.X), py(q.Y), x, y, col)
			}
		}
		ly := top + 10 + 20*i
		for d := 0; d < 3; d++ {
			hline(img, right+16, right+40, ly-4+d, col)
		}
		text(img, right+48, ly+2, s.Name, black)
	}
	return img, nil
}

// decimals is the number of decimals that show multiples of step.
func decimals(step float64) int {
	d := 0
	for step < 1 && d < 9 {
		step *= 10
		d++
	}
	return d
}

// niceCeil returns an axis top of 1, 2 or 5 times a power of ten at or
// above v, with at most 6 steps, and its step.
func niceCeil(v float64) (top, step float64) {
	if v <= 0 {
		return 1, 0.2
	}
	mag := math.Pow(10, math.Floor(math.Log10(v/5)))
	for _, m := range []float64{1, 2, 5, 10} {
		step = m * mag
		if top = math.Ceil(v/step) * step; top/step <= 6 {
			return top, step
		}
	}
	return math.Ceil(v/step) * step, step
}

func text(img *image.RGBA, x, y int, s string, c color.Color) {
	d := font.Drawer{Dst: img, Src: image.NewUniform(c), Face: basicfont.Face7x13, Dot: fixed.P(x, y)}
	d.DrawString(s)
}

func hline(img *image.RGBA, x0, x1, y int, c color.Color) {
	for x := x0; x <= x1; x++ {
		img.Set(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.Color) {
	for y := y0; y <= y1; y++ {
		img.Set(x, y, c)
	}
}

func square(img *image.RGBA, x, y, r int, c color.Color) {
	for i := -r; i <= r; i++ {
		for j := -r; j <= r; j++ {
			img.Set(x+i, y+j, c)
		}
	}
}

// line draws a 2-pixel line (Bresenham, thickened vertically).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.Color) {
	dx, dy := abs(x1-x0), -abs(y1-y0)
	sx, sy := sign(x1-x0), sign(y1-y0)
	e := dx + dy
	for {
		img.Set(x0, y0, c)
		img.Set(x0, y0+1, c)
		if x0 == x1 && y0 == y1 {
			return
		}
		e2 := 2 * e
		if e2 >= dy {
			e += dy
			x0 += sx
		}
		if e2 <= dx {
			e += dx
			y0 += sy
		}
	}
}

func abs(v int) int {
	if v < 0 {
		return -v
	}
	return v
}

func sign(v int) int {
	switch {
	case v < 0:
		return -1
	case v > 0:
		return 1
	}
	return 0
}

// WritePanelsPNGFile draws charts one above the other into one PNG file
// at path (each at its own size, on a white ground).
func WritePanelsPNGFile(path string, charts ...*Chart) error {
	var imgs []*image.RGBA
	w, h := 0, 0
	for _, c := range charts {
		img, err := c.Draw()
		if err != nil {
			return err
		}
		imgs = append(imgs, img)
		w, h = max(w, img.Bounds().Dx()), h+img.Bounds().Dy()
	}
	out := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(out, out.Bounds(), image.White, image.Point{}, draw.Src)
	y := 0
	for _, img := range imgs {
		draw.Draw(out, image.Rect(0, y, img.Bounds().Dx(), y+img.Bounds().Dy()), img, img.Bounds().Min, draw.Src)
		y += img.Bounds().Dy()
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := png.Encode(f, out); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
