#!/usr/bin/env bash
# The tuning sweep of TUNING.md (issue 15, first step): nano, batch 16 x 32 bytes per worker-step,
# steps per worker = tokens-per-parameter x 58,656 / (M x 512) so every M sees the same total tokens.
# One simulation at a time. Each run writes runs/<exp>__<label>.json; log.tsv gets one line per run.
# Usage (repo root): bash benchmarks/results/quality-long/sweep.sh [EXPERIMENT ...]   (default: all)
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per run: the 2-core VM is shared
D=benchmarks/results/quality-long
mkdir -p "$D/runs"
SD=.venv/bin/streamdiloco
B=${BATCH:-16}  # sequences per worker-step (BATCH=4 bash sweep.sh ...: smaller batches, more steps and rounds)
steps() { python3 -c "print(round($1 * 58656 / ($2 * $B * 32)))"; }  # tokens/param, M
run() {  # exp label M tpp method [flags...]
  local exp=$1 label=$2 m=$3 tpp=$4 method=$5; shift 5
  local n; n=$(steps "$tpp" "$m")
  local out="$D/runs/${exp}__${label}.json"
  if [ ! -s "$out" ]; then
    $SD simulate --model nano --method "$method" --workers "$m" --steps "$n" --batch-size "$B" --eval-every 100000 \
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
e11() {  # which part of the full method costs, at M = 4, inner lr 5e-3; and M = 1 against DP
  local F32=(--uplink-codec fp32 --downlink-codec fp32)
  run e11 diloco-fp32-M4-lr5e-3 4 20 streaming --num-fragments 1 --fragment-sync-delay 0 "${F32[@]}" --lr 5e-3
  run e11 stream-fp32-M4-lr5e-3 4 20 streaming "${FULL[@]}" "${F32[@]}" --lr 5e-3
  run e11 full-alpha0-M4-lr5e-3 4 20 streaming "${FULL[@]}" --fragment-update-alpha 0 --lr 5e-3
  for lr in 5e-3 1.2e-2; do
    run e11 dp-M1-lr$lr 1 20 dp --lr $lr; run e11 full-M1-lr$lr 1 20 streaming "${FULL[@]}" --lr $lr
  done
}
e12() {  # larger inner lrs with a smaller outer lr (does the outer step's gain cap the inner lr?)
  for m in 4 8; do for lr in 8e-3 1.2e-2; do for om in "0.5 0.9" "0.3 0.9"; do
    set -- $om
    run e12 full-M$m-lr$lr-olr$1-mom$2 $m 20 streaming "${FULL[@]}" --lr $lr --outer-lr $1 --outer-momentum $2
  done; done; done
}
e13() {  # the outer momentum's share: plain averaging (momentum 0) up to 0.8, at M = 4
  for lr in 5e-3 1.2e-2; do for om in "1.0 0" "1.0 0.5" "1.0 0.8" "0.5 0.8"; do
    set -- $om
    run e13 full-M4-lr$lr-olr$1-mom$2 4 20 streaming "${FULL[@]}" --lr $lr --outer-lr $1 --outer-momentum $2
  done; done
}
fortunes() {  # the second text: Debian's `fortunes` package (apt-get install fortunes), as quality_long.py makes it
  .venv/bin/python -c "from pathlib import Path
from benchmarks.quality_long import fortunes_text; print(fortunes_text(Path('$D/runs')))"
}
e14() {  # the second text (fortunes): defaults, and each method's tuned inner lr
  local t; t=$(fortunes)
  for m in 2 4; do
    run e14 dp-M$m-fortunes $m 20 dp --data "$t"
    run e14 full-M$m-fortunes $m 20 streaming "${FULL[@]}" --data "$t"
    for lr in 5e-3 1.2e-2; do run e14 dp-M$m-lr$lr-fortunes $m 20 dp --data "$t" --lr $lr; done
    run e14 full-M$m-lr5e-3-fortunes $m 20 streaming "${FULL[@]}" --data "$t" --lr 5e-3
    run e14 full-M$m-lr1.2e-2-mom0-fortunes $m 20 streaming "${FULL[@]}" --data "$t" --lr 1.2e-2 --outer-momentum 0
  done
}
e15() {  # plain averaging at a large inner lr at M = 2 and 8, and M = 8's best outer setting on seed 1
  for m in 2 8; do run e15 full-M$m-lr1.2e-2-mom0 $m 20 streaming "${FULL[@]}" --lr 1.2e-2 --outer-momentum 0; done
  run e15 full-M8-lr5e-3-olr0.7-mom0.95-seed1 8 20 streaming "${FULL[@]}" --lr 5e-3 --outer-lr 0.7 --seed 1
  run e15 dp-M8-lr8e-3-seed1 8 20 dp --lr 8e-3 --seed 1
}
e16() {  # around plain averaging (outer momentum 0) at M = 4: extrapolation, H, inner lr, alpha
  local P0=("${FULL[@]}" --outer-momentum 0)
  for olr in 1.5 2.0; do run e16 full-M4-lr1.2e-2-olr$olr-mom0 4 20 streaming "${P0[@]}" --lr 1.2e-2 --outer-lr $olr; done
  for h in 10 15; do run e16 full-M4-lr1.2e-2-mom0-H$h 4 20 streaming "${P0[@]}" --lr 1.2e-2 --sync-every $h; done
  for lr in 8e-3 2e-2; do run e16 full-M4-lr$lr-mom0 4 20 streaming "${P0[@]}" --lr $lr; done
  run e16 full-M4-lr1.2e-2-mom0-alpha0 4 20 streaming "${P0[@]}" --lr 1.2e-2 --fragment-update-alpha 0
  run e16 dp-M4-lr2e-2 4 20 dp --lr 2e-2
}
e17() {  # one site alone for the same wall time (the steps of one worker at M = 4 and 8): does joining pay?
  for lr in 5e-3 1.2e-2; do
    run e17 alone-M4-steps-lr$lr 1 5 dp --lr $lr
    run e17 alone-M8-steps-lr$lr 1 2.5 dp --lr $lr
  done
}
e18() {  # more outer rounds at M = 4: batch 4 (4x the steps at equal tokens), or 80 tokens/param
  if [ "$B" = 4 ]; then
    for lr in 5e-3 1.2e-2; do run e18 dp-M4-b4-lr$lr 4 20 dp --lr $lr; done
    run e18 full-M4-b4-lr5e-3 4 20 streaming "${FULL[@]}" --lr 5e-3
    run e18 full-M4-b4-lr1.2e-2-mom0 4 20 streaming "${FULL[@]}" --lr 1.2e-2 --outer-momentum 0
  else
    for lr in 1.2e-2 2e-2; do run e18 dp-M4-tpp80-lr$lr 4 80 dp --lr $lr; done
    run e18 full-M4-tpp80-lr5e-3 4 80 streaming "${FULL[@]}" --lr 5e-3
    run e18 full-M4-tpp80-lr1.2e-2-mom0 4 80 streaming "${FULL[@]}" --lr 1.2e-2 --outer-momentum 0
  fi
}
e19() {  # sanity: averaging the replicas after every step (H = 1, plain, fp32) against DP; fortunes M = 4
  local AVG=(--num-fragments 1 --fragment-sync-delay 0 --fragment-update-alpha 0 --uplink-codec fp32
    --downlink-codec fp32 --outer-lr 1 --outer-momentum 0 --sync-every 1)
  for lr in 5e-3 1.2e-2; do run e19 avg-every-step-M4-lr$lr 4 20 streaming "${AVG[@]}" --lr $lr; done
  local t; t=$(fortunes)
  run e19 full-M4-fortunes-olr0.7-mom0.9 4 20 streaming "${FULL[@]}" --data "$t" --outer-lr 0.7 --outer-momentum 0.9
  run e19 full-M4-fortunes-H10 4 20 streaming "${FULL[@]}" --data "$t" --sync-every 10
  run e19 full-M4-fortunes-seed1 4 20 streaming "${FULL[@]}" --data "$t" --seed 1
  run e19 dp-M4-fortunes-seed1 4 20 dp --data "$t" --seed 1
}
e20() {  # the tuned gap at M = 4 against the budget: 40, 160, 320 tokens/param (80: e18)
  for tpp in 40 160 320; do
    run e20 dp-M4-tpp$tpp-lr1.2e-2 4 $tpp dp --lr 1.2e-2
    run e20 full-M4-tpp$tpp-lr5e-3 4 $tpp streaming "${FULL[@]}" --lr 5e-3
    run e20 full-M4-tpp$tpp-lr1.2e-2-mom0 4 $tpp streaming "${FULL[@]}" --lr 1.2e-2 --outer-momentum 0
  done
  run e20 dp-M4-tpp320-lr5e-3 4 320 dp --lr 5e-3
}
e21() {  # 160 tokens/param at M = 2 and 8 on the plays and M = 4 on fortunes: DP at 1.2e-2, the defaults' outer
  for m in 2 8; do
    run e21 dp-M$m-tpp160-lr1.2e-2 $m 160 dp --lr 1.2e-2
    run e21 full-M$m-tpp160-lr5e-3 $m 160 streaming "${FULL[@]}" --lr 5e-3
  done
  local t; t=$(fortunes)
  run e21 dp-M4-tpp160-lr1.2e-2-fortunes 4 160 dp --data "$t" --lr 1.2e-2
  run e21 full-M4-tpp160-lr5e-3-fortunes 4 160 streaming "${FULL[@]}" --data "$t" --lr 5e-3
}
[ $# -gt 0 ] || set -- e0 e1 e2 e3 e4 e5 e6 e7 e8 e9 e10
for e in "$@"; do "$e"; done
