#!/bin/sh
# perf-h2.sh PEER [BLOCKS]: where a server of BenchmarkVersusNginx's HTTP/2
# row at 8 clients spends its CPU, from `perf record -a` (1999 Hz) over
# BLOCKS blocks (default 3000): the server process's samples per block,
# by category. PEER is tls-floor, tls-floor-plain, tls-floor-handlers,
# bare, holder, holder-plain, holder-1p or tls-floor-1p (the Go servers;
# nginx's OpenSSL symbols are not resolved here). HOLDER_TEST names a holder test binary to use
# rather than one built from this tree. Needs perf, nginx, and root.
set -eu
peer=$1
blocks=${2:-3000}
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=${HOLDER_TEST:-$out/holder.test}
[ -n "${HOLDER_TEST:-}" ] || go test -tags nogpu -c -o "$bin" ./holder/
cd holder
KVSP_BENCH_NGINX=1 perf record -q -a -F 1999 -o "$out/perf.data" -- "$bin" -test.run '^$' \
	-test.bench "VersusNginx/h2/clients=8/$peer\$" -test.benchtime "${blocks}x" | grep '^Benchmark'
perf script -i "$out/perf.data" -F pid,ip,sym,dso 2>/dev/null | awk -v n="$blocks" -v peer="$peer" '
function cat(sym, dso) {
	if (sym ~ /gcmAes|gcm\.seal|encryptBlock/) return "sealing (AES-GCM)"
	if (dso ~ /kernel/) {
		if (sym ~ /copy_from_iter|copy_to_iter|copy_user|rep_movs|clear_page/) return "kernel copies"
		if (sym ~ /futex|schedule|switch_to|finish_task_switch|wake|ttwu|enqueue|dequeue|pick_next|update_curr|spin_unlock_irqrestore|queued_spin|select_task|idle|hrtimer|tick/) return "kernel scheduling, wake-ups"
		return "kernel TCP, syscalls"
	}
	if (sym ~ /memmove|memcpy/) return "plaintext copy (memmove)"
	if (sym ~ /^github.com\/kvsp/) return "kvsp code"
	if (sym ~ /^(runtime|internal\/runtime)\./) return "Go runtime"
	if (sym ~ /^crypto\//) return "crypto/tls, other"
	return "other"
}
{
	pid = $1; dso = $NF; $1 = ""; $2 = ""; $NF = ""; sym = $0; gsub(/^ +| +$/, "", sym)
	total[pid]++; c[pid SUBSEP cat(sym, dso)]++
}
END {
	# the client is the process with the most samples, the server the next
	for (p in total) if (total[p] > total[a]) a = p
	for (p in total) if (p != a && total[p] > total[s]) s = p
	printf "%s: %.2f samples per block\n", peer, total[s] / n
	for (k in c) { split(k, f, SUBSEP); if (f[1] == s) printf "  %-30s %.2f\n", f[2], c[k] / n }
}' | sort -k1,1 -s
