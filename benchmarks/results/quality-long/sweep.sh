#!/usr/bin/env bash
# The tuning sweep of TUNING.md (issue 15, first step): nano, batch 16 x 32 bytes per worker-step,
# steps per worker = tokens-per-parameter x 58,656 / (M x 512) so every M sees the same total tokens.
# One simulation at a time. Each run writes runs/<exp>__<label>.json; log.tsv gets one line per run.
# Usage (repo root): bash benchmarks/results/quality-long/sweep.sh [EXPERIMENT ...]   (default: all)
set -euo pipefail
D=benchmarks/results/quality-long
mkdir -p "$D/runs"
SD=.venv/bin/streamdiloco
steps() { python3 -c "print(round($1 * 58656 / ($2 * 512)))"; }  # tokens/param, M
run() {  # exp label M tpp method [flags...]
  local exp=$1 label=$2 m=$3 tpp=$4 method=$5; shift 5
  local n; n=$(steps "$tpp" "$m")
  local out="$D/runs/${exp}__${label}.json"
  if [ ! -s "$out" ]; then
    $SD simulate --model nano --method "$method" --workers "$m" --steps "$n" --eval-every 100000 \
      --json "$out" "$@" > /dev/null
  fi
  local loss; loss=$(python3 -c "import json;print(f\"{json.load(open('$out'))['eval_loss']:.4f}\")")
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$exp" "$label" "$m" "$tpp" "$method" "$*" "$loss" | tee -a "$D/log.tsv"
}
FULL=(--fragment-sync-delay 1 --fragment-update-alpha 0.5 --uplink-codec e3m0 --downlink-codec e3m0)

e0() {  # baseline: defaults, 20 tokens/param
  for m in 2 4 8; do run e0 dp-M$m $m 20 dp; run e0 full-M$m $m 20 streaming "${FULL[@]}"; done
}
e1() {  # data-parallel's (and the full method's) inner lr
  for m in 2 4 8; do for lr in 2e-3 3e-3 5e-3; do
    run e1 dp-M$m-lr$lr $m 20 dp --lr $lr
    run e1 full-M$m-lr$lr $m 20 streaming "${FULL[@]}" --lr $lr
  done; done
}
e2() {  # outer lr and momentum per M
  for m in 4 8; do for olr in 0.7 1.0 1.4; do for mom in 0.9 0.95; do
    run e2 full-M$m-olr$olr-mom$mom $m 20 streaming "${FULL[@]}" --outer-lr $olr --outer-momentum $mom
  done; done; done
}
e3() {  # H per M
  for m in 4 8; do for h in 10 20 50; do
    run e3 full-M$m-H$h $m 20 streaming "${FULL[@]}" --sync-every $h
  done; done
}
e4() {  # token budget: 40 tokens/param
  for m in 2 4 8; do run e4 dp-M$m $m 40 dp; run e4 full-M$m $m 40 streaming "${FULL[@]}"; done
}
e5() {  # a second seed for the baseline
  for m in 2 4 8; do
    run e5 dp-M$m-seed1 $m 20 dp --seed 1; run e5 full-M$m-seed1 $m 20 streaming "${FULL[@]}" --seed 1
  done
}
e6() {  # data-parallel's lr beyond 5e-3 (e1's best was its largest)
  for m in 2 4 8; do for lr in 8e-3 1.2e-2; do run e6 dp-M$m-lr$lr $m 20 dp --lr $lr; done; done
}
e7() {  # outer lr / momentum at the inner lr 5e-3 (e1's best for both methods at M = 2 and 4)
  for m in 4 8; do for om in "0.7 0.9" "1.0 0.9" "0.7 0.95" "1.4 0.95" "0.5 0.9"; do
    set -- $om
    run e7 full-M$m-lr5e-3-olr$1-mom$2 $m 20 streaming "${FULL[@]}" --lr 5e-3 --outer-lr $1 --outer-momentum $2
  done; done
}
e8() {  # H per M at the inner lr 5e-3
  for m in 4 8; do for h in 10 20; do
    run e8 full-M$m-lr5e-3-H$h $m 20 streaming "${FULL[@]}" --lr 5e-3 --sync-every $h
  done; done
}
e9() {  # a second seed at the inner lr 5e-3
  for m in 4 8; do
    run e9 dp-M$m-lr5e-3-seed1 $m 20 dp --lr 5e-3 --seed 1
    run e9 full-M$m-lr5e-3-seed1 $m 20 streaming "${FULL[@]}" --lr 5e-3 --seed 1
  done
}
e10() {  # the full method at e6's larger inner lrs
  for m in 4 8; do for lr in 8e-3 1.2e-2; do
    run e10 full-M$m-lr$lr $m 20 streaming "${FULL[@]}" --lr $lr
  done; done
  run e10 full-M2-lr8e-3 2 20 streaming "${FULL[@]}" --lr 8e-3
}
[ $# -gt 0 ] || set -- e0 e1 e2 e3 e4 e5 e6 e7 e8 e9 e10
for e in "$@"; do "$e"; done
