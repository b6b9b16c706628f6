#!/usr/bin/env bash
# Every method on a task that can tell them apart: Fashion-MNIST (60,000 training images, the
# 10,000 test images for validation), ResNet-8, plain SGD with Nesterov momentum and a cosine
# schedule to 0 over EPOCHS epochs, 32 images per worker, every method over SEEDS, in two cells:
#   iid4: 4 workers, IID shards;   dir8: 8 workers, Dirichlet(0.5) shards (both simulated on the
#   CPU cores with ddp.oversubscribe=true), where every method averages the workers' module buffers
#   (the per-step ones every step, comm.buffers=average; the local-step ones at their exchanges).
# Each method runs with its paper's settings as the embedded experiments scale them; DGC's warm-up
# (4 densities) is scaled to 2.5 % of the run, as in the paper (4 of 160 epochs).
# `shared_topk_int8_lean` is compressor=shared_topk_int8 as its config sets it (shared-index int8,
# Golomb positions, one warm-up step); `shared_topk_int8` is LGC's ablation (LGC-RAR's 30 dense
# warm-up steps and raw positions); `lgc_rar_lean` is LGC-RAR on the same lean footing (linear codec,
# int8 latents, Golomb positions, one warm-up step).
# The `_all` variants send every parameter through the codec (comm.min_numel=0): by default the
# parameters under 1,024 elements (BatchNorm's, ResNet-8's first convolution) travel dense, which
# is most of a per-step compressor's parameter bytes on ResNet-8 (lgc-report's "where the bytes go").
# The `_delay` variants exchange the weight updates of 4 local steps, as SBC with delay does, through
# shared-index int8 lean or LGC-RAR lean (their stages counted in exchanges).
# Runs write to OUT (checkpoints and logs included); each finished run's summary.json is copied to
# RESULTS/CELL/METHOD/seedN (committed as they arrive). Resumable: a run whose summary.json is in
# RESULTS or OUT is skipped, and a stopped run resumes exactly from its last epoch's checkpoint
# (ckpt_path), so the sweep can run over several sittings. After each cell, lgc-report writes
# RESULTS/CELL/report (the table over seeds: mean and 95 % interval, the gap to dense paired by
# seed); after the cells, experiments/lgc_verdict.py writes RESULTS/lgc_verdict.md (LGC's best
# setting against DGC and the best non-learned codec, cell by cell) and experiments/default_rule.py
# RESULTS/default_rule.md (docs/evidence.md's rule for lgc-train's default, with results/step_cost). About
# 4 min per 4-worker run on 2 cores. JOBS=N runs N at once (on a machine with at least N x workers
# cores; each worker then gets cores / (N x workers) torch threads), each run's output in
# OUT/CELL/METHOD/seedN.log; a failed run is listed at the end and the others go on.
#   experiments/fashion_mnist_comparison.sh [OUT]
#   CELLS=iid4 SEEDS="0 1 2" EPOCHS=4 METHODS="dense topk" JOBS=1 experiments/fashion_mnist_comparison.sh
# EXTRA adds overrides to every run, e.g. on one GPU with ResNet-20 (the workers share the GPU over gloo):
#   EXTRA="trainer=gpu model=resnet20" RESULTS=experiments/results/fashion_mnist_gpu CELLS=iid4 JOBS=3 \
#     experiments/fashion_mnist_comparison.sh outputs/fashion_mnist_gpu
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-outputs/fashion_mnist_comparison}
results=${RESULTS:-experiments/results/fashion_mnist}
epochs=${EPOCHS:-4}
seeds=${SEEDS:-0 1 2}
cells=${CELLS:-iid4 dir8}
jobs_max=${JOBS:-1}
read -r -a everywhere <<< "${EXTRA:-}"
[[ $jobs_max =~ ^[1-9][0-9]*$ ]] || { echo "JOBS=$jobs_max must be a positive integer" >&2; exit 2; }
failed=()

declare -A method=(
  [dense]="compressor=none"
  [fp16]="experiment=embedded/fp16"
  [powersgd]="experiment=embedded/powersgd compressor.matrix_approximation_rank=2"
  [topk]="experiment=embedded/topk"
  [dgc]="experiment=embedded/dgc"
  [sbc]="experiment=embedded/sbc"
  [sbc_delay]="experiment=embedded/sbc_delay"
  [redsync]="experiment=embedded/redsync_trimmed"
  [random_block]="experiment=embedded/random_block"
  [qsgd]="experiment=embedded/qsgd"
  [terngrad]="experiment=embedded/terngrad"
  [signsgd]="experiment=embedded/signsgd"
  [shared_topk_fp16]="experiment=embedded/shared_topk compressor.values=float16 compressor.measure_error=false"
  [shared_topk_int8]="experiment=embedded/shared_topk_int8"
  [shared_topk_int8_lean]="compressor=shared_topk_int8"
  [lgc_rar]="experiment=embedded/lgc_rar"
  [lgc_ps]="experiment=embedded/lgc_ps"
  [lgc_rar_linear]="experiment=embedded/lgc_rar_linear"
  [lgc_rar_lean]="experiment=embedded/lgc_rar_lean"
  [shared_topk_int8_lean_all]="compressor=shared_topk_int8 comm.min_numel=0"
  [lgc_rar_lean_all]="experiment=embedded/lgc_rar_lean comm.min_numel=0"
  [sbc_delay_all]="experiment=embedded/sbc_delay comm.min_numel=0"
  [shared_topk_int8_lean_delay]="compressor=shared_topk_int8 comm=local_sgd comm.delay=4"
  [shared_topk_int8_lean_delay_all]="compressor=shared_topk_int8 comm=local_sgd comm.delay=4 comm.min_numel=0"
  [lgc_rar_lean_delay]="experiment=embedded/lgc_rar_lean comm=local_sgd comm.delay=4"
  [lgc_rar_lean_delay_all]="experiment=embedded/lgc_rar_lean comm=local_sgd comm.delay=4 comm.min_numel=0"
  [diloco_h10]="experiment=diloco"
  [diloco_h50]="experiment=diloco comm.delay=50"
  [sparseloco]="experiment=sparseloco"
  [demo]="experiment=demo"
)
order=(dense fp16 powersgd topk dgc sbc sbc_delay redsync random_block qsgd terngrad signsgd shared_topk_fp16
       shared_topk_int8 shared_topk_int8_lean lgc_rar lgc_ps lgc_rar_linear lgc_rar_lean diloco_h10 diloco_h50
       sparseloco demo shared_topk_int8_lean_all lgc_rar_lean_all sbc_delay_all shared_topk_int8_lean_delay
       shared_topk_int8_lean_delay_all lgc_rar_lean_delay lgc_rar_lean_delay_all)
read -r -a chosen <<< "${METHODS:-${order[*]}}"

declare -A cell=(
  [iid4]="trainer.devices=4"
  [dir8]="trainer.devices=8 data.partition=dirichlet data.alpha=0.5"
)
# The methods that exchange the weight updates of local steps: they average the workers' module
# buffers at every exchange. The per-step methods average them every step in the Dirichlet cell
# (comm.buffers=average), where rank 0's BatchNorm statistics describe rank 0's skewed shard only.
local_steps=" sbc_delay sbc_delay_all shared_topk_int8_lean_delay shared_topk_int8_lean_delay_all lgc_rar_lean_delay
  lgc_rar_lean_delay_all diloco_h10 diloco_h50 sparseloco "
declare -A per_step_buffers=(
  [iid4]=""
  [dir8]="comm.buffers=average"
)

for name in $cells; do
  [[ -v "cell[$name]" ]] || { echo "unknown cell $name (iid4, dir8)" >&2; exit 2; }
  workers=$(sed -E 's/.*trainer.devices=([0-9]+).*/\1/' <<< "${cell[$name]}")
  steps_per_epoch=$(( 60000 / (32 * workers) ))
  # DGC's 4 warm-up densities over 2.5 % of the run (steps_per_epoch is DGC's epoch length).
  dgc_epoch=$(( steps_per_epoch * epochs / 160 )); (( dgc_epoch > 0 )) || dgc_epoch=1
  for m in "${chosen[@]}"; do
    [[ -v "method[$m]" ]] || { echo "unknown method $m" >&2; exit 2; }
    extra=()
    [[ $m == dgc ]] && extra=("compressor.steps_per_epoch=$dgc_epoch")
    [[ -n ${per_step_buffers[$name]} && $local_steps != *" $m "* ]] && extra+=("${per_step_buffers[$name]}")
    for seed in $seeds; do
      dir="$out/$name/$m/seed$seed" kept="$results/$name/$m/seed$seed"
      if [ -f "$dir/summary.json" ] && [ ! -f "$kept/summary.json" ]; then
        mkdir -p "$kept" && cp "$dir/summary.json" "$kept/"
      fi
      [ -f "$kept/summary.json" ] && continue  # done already: the sweep resumes where it stopped
      resume=()
      [ -f "$dir/checkpoints/last.ckpt" ] && resume=("ckpt_path=$dir")  # stopped mid-run: go on from there
      # shellcheck disable=SC2086  # the settings are word lists
      run=(lgc-train data=fashion_mnist data.batch_size=32 ${cell[$name]} ddp.oversubscribe=true
        trainer.max_epochs="$epochs" seed="$seed" logger=csv trainer.enable_progress_bar=false
        "${everywhere[@]}" ${method[$m]} "${extra[@]}" output_dir="$dir" "${resume[@]}")
      if (( jobs_max == 1 )); then
        if "${run[@]}"; then mkdir -p "$kept" && cp "$dir/summary.json" "$kept/"; else failed+=("$name/$m/seed$seed"); fi
        continue
      fi
      while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
      mkdir -p "$(dirname "$dir")"
      (
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / (jobs_max * workers) > 0 ? $(nproc) / (jobs_max * workers) : 1 ))}
        "${run[@]}" > "$dir.log" 2>&1 && mkdir -p "$kept" && cp "$dir/summary.json" "$kept/"
      ) &
    done
  done
  wait
  for m in "${chosen[@]}"; do
    for seed in $seeds; do
      [ -f "$results/$name/$m/seed$seed/summary.json" ] || failed+=("$name/$m/seed$seed")
    done
  done
  lgc-report "$results/$name" --label folder --out "$results/$name/report" --json "$results/$name/report/rows.json"
done
# RESULTS/lgc_verdict.md and RESULTS/default_rule.md, once both cells are complete (provisional until then).
python "$(dirname "$0")/lgc_verdict.py" "$results" > /dev/null || echo "lgc_verdict.py failed" >&2
python "$(dirname "$0")/default_rule.py" "$results" > /dev/null || echo "default_rule.py failed" >&2
if (( ${#failed[@]} )); then
  printf 'unfinished: %s\n' "${failed[@]}" | sort -u >&2
  exit 1
fi
