#!/usr/bin/env bash
# Start the league's GPU runs at once, each in its own process session (so they outlive the calling shell), and
# return. One run per ALGO x SEED: experiments/qwen_image_ocr.py's <algo>-tiny-gpu preset (tiny-gpu for grpo),
# named gpu_<label>_s<seed> under OUT, its console in OUT/logs/. Extra arguments go to every run.
#
#   benchmarks/league_launch.sh OUT "grpo dppo mixgrpo nft awm" "60 61 62" [--num-steps 300 ...]
#   LABEL=nft-decay1 benchmarks/league_launch.sh OUT nft "60 61 62" --algo.ema-rate 0.001 ...
#   python3 benchmarks/league.py OUT --plot OUT/league.png      # the table and the figure
#
# Every run reads the held-out words with the CPU reader in run.val_workers processes: keep the total below the
# machine's cores (the renderer uses a few % of a GPU; the host is what bounds many runs at once).
set -euo pipefail
out=$1 algos=$2 seeds=$3
shift 3
mkdir -p "$out/logs"
for a in $algos; do
  preset=$([ "$a" = grpo ] && echo tiny-gpu || echo "$a-tiny-gpu")
  for s in $seeds; do
    name="gpu_${LABEL:-$a}_s$s"
    setsid nohup python3 experiments/qwen_image_ocr.py "$preset" --seed "$s" --exp-name "$name" \
      --run.out-dir "$out" "$@" >"$out/logs/$name.log" 2>&1 </dev/null &
  done
done
