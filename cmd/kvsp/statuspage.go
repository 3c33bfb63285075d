package main

import (
	"cmp"
	"fmt"
	"html/template"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvsp/kvsp"
	"github.com/kvsp/kvsp/controlplane/placement"
)

// statusPage is the PC's read-only status page on metrics_listen:
// instances with their state, epoch and load, sessions, the hit ratio and
// the octets moved. Server-rendered, no script; it shows no keys, tokens
// or KV octets (session ids and instance URIs are not secrets).
type statusPage struct {
	pc  *placement.Controller
	reg prometheus.Gatherer
	// models names each compat_id's model (the descriptors this process
	// loads); engines each instance of this process's engine kind.
	models  map[kvsp.CompatID]string
	engines map[string]string
}

// statusInstance is an instance's row.
type statusInstance struct {
	placement.Snapshot
	Engine, Model string
}

type statusData struct {
	Now                                   string
	Instances                             []statusInstance
	Sessions                              []placement.SessionSummary
	SessionCount                          int
	Placed, Migrations, Directives        float64
	CachedTokens, ComputedTokens, HitRate float64
	Served, Fetched                       string
}

var statusTemplate = template.Must(template.New("status").Funcs(template.FuncMap{
	"short": func(s string) string { return s[:min(8, len(s))] },
	"age":   func(t time.Time) string { return time.Since(t).Round(time.Second).String() },
	"pct":   func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) },
}).Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>kvsp placement controller</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px;margin:0 0 4px}
.sub{color:#666;margin-bottom:16px}
.cards{display:flex;gap:12px;margin-bottom:20px}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:120px}
.card b{display:block;font-size:20px}
table{border-collapse:collapse;margin-bottom:20px}
th,td{border-bottom:1px solid #eee;padding:4px 10px;text-align:left}
th{background:#f6f6f6}
.active{color:#197a1f}.failed{color:#b00020}.draining,.sleeping{color:#8a6d00}
</style></head><body>
<h1>kvsp placement controller</h1>
<div class="sub">read-only; refreshed every 5 s; {{.Now}}</div>
<div class="cards">
<div class="card">prefix hit ratio<b>{{pct .HitRate}}</b>of prompt tokens</div>
<div class="card">placements<b>{{printf "%.0f" .Placed}}</b>{{printf "%.0f" .Directives}} prefetch directives</div>
<div class="card">migrations<b>{{printf "%.0f" .Migrations}}</b>sessions moved</div>
<div class="card">served by holders<b>{{.Served}}</b>fetched by instances: {{.Fetched}}</div>
</div>
<h2>Instances</h2>
<table><tr><th>instance</th><th>engine</th><th>model</th><th>state</th><th>epoch</th><th>running</th><th>queued</th><th>batch</th><th>prefill tokens/s</th><th>decode tokens/s</th><th>placed since status</th><th>pending directives</th></tr>
{{range .Instances}}<tr><td>{{.Status.Instance}}</td><td>{{.Engine}}</td><td>{{.Model}}</td><td class="{{.State}}">{{.State}}</td><td>{{.Status.Epoch}}</td><td>{{.Status.Running}}</td><td>{{.Status.Queued}}</td><td>{{.Status.BatchSize}}</td><td>{{printf "%.0f" .Status.PrefillTokensPerS}}</td><td>{{printf "%.0f" .Status.DecodeTokensPerS}}</td><td>{{.Placed}}</td><td>{{.Pending}}</td></tr>
{{else}}<tr><td colspan="12">no instance has reported</td></tr>{{end}}</table>
<div class="sub">engine: this process's configuration (— for an instance of another process); model: its descriptor's; rates: what the instance reported (the llama.cpp engine's are measured moving averages, the simulated engine's its configuration)</div>
<h2>Sessions ({{.SessionCount}})</h2>
<table><tr><th>session</th><th>epoch</th><th>instance</th><th>output offset</th><th>max tokens</th><th>age</th></tr>
{{range .Sessions}}<tr><td>{{short .ID.String}}…</td><td>{{.Epoch}}</td><td>{{.Instance}}</td><td>{{.OutputOffset}}</td><td>{{.MaxTokens}}</td><td>{{age .Created}}</td></tr>
{{else}}<tr><td colspan="6">none</td></tr>{{end}}</table>
</body></html>
`))

func (p *statusPage) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	m := gatherSums(p.reg)
	d := statusData{Now: time.Now().UTC().Format(time.RFC3339), Sessions: p.pc.Sessions()}
	for _, sn := range p.pc.Registry().All() {
		row := statusInstance{Snapshot: sn, Engine: cmp.Or(p.engines[sn.Status.Instance], "—"), Model: p.models[sn.Status.CompatID]}
		if row.Model == "" {
			row.Model = "compat " + sn.Status.CompatID.String()[:min(12, len(sn.Status.CompatID.String()))] + "…"
		}
		d.Instances = append(d.Instances, row)
	}
	slices.SortFunc(d.Instances, func(a, b statusInstance) int { return strings.Compare(a.Status.Instance, b.Status.Instance) })
	d.SessionCount = len(d.Sessions)
	d.Sessions = d.Sessions[:min(len(d.Sessions), 50)]
	d.Placed = metricSum(m, "kvsp_pc_placements_total", `outcome="placed"`)
	d.Directives = metricSum(m, "kvsp_pc_directives_total", `outcome="sent"`)
	d.Migrations = metricSum(m, "kvsp_pc_migrations_total")
	d.CachedTokens = metricSum(m, "kvsp_instance_prompt_tokens_total", `source="cached"`)
	d.ComputedTokens = metricSum(m, "kvsp_instance_prompt_tokens_total", `source="computed"`)
	if t := d.CachedTokens + d.ComputedTokens; t > 0 {
		d.HitRate = d.CachedTokens / t
	}
	d.Served = sizeName(int(metricSum(m, "kvsp_holder_bytes_served_total")) &^ (1<<10 - 1))
	d.Fetched = sizeName(int(metricSum(m, "kvsp_instance_fetched_bytes_total")) &^ (1<<10 - 1))
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if err := statusTemplate.Execute(w, &d); err != nil {
		http.Error(w, "status page: "+err.Error(), http.StatusInternalServerError)
	}
}

// gatherSums reads a registry into the form scrapeMetrics gives:
// name{labels} and name (summed over labels).
func gatherSums(g prometheus.Gatherer) map[string]float64 {
	out := map[string]float64{}
	mfs, err := g.Gather()
	if err != nil {
		return out
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var v float64
			switch {
			case m.GetCounter() != nil:
				v = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				v = m.GetGauge().GetValue()
			default:
				continue
			}
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			key := mf.GetName()
			if len(labels) > 0 {
				out[key+"{"+strings.Join(labels, ",")+"}"] += v
			}
			out[key] += v
		}
	}
	return out
}
