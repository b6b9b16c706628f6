#!/usr/bin/env bash
# lgc on one CUDA device, in about 5 minutes: the GPU tests, then the benchmarks whose results are in
# results/gpu_h200/ (a machine with lgc[dev] installed and one or more GPUs).
#   tests: every method of the test matrix in DDP over NCCL (tests/ddp/test_devices.py), the
#          lgc's collectives and point-to-point messages over gloo with CUDA tensors (two workers
#          sharing one GPU, tests/ddp/test_gloo_devices.py), the reference comparisons on CUDA, the
#          GPU benchmark test;
#   lgc-bench compressors --device cuda: encode + decode of ResNet-50's gradients, every codec with a
#          bucket-level path both ways (a bucket at once and tensor by tensor: top-k, DGC, SBC,
#          EF-signSGD, chunked top-k, SparseLoCo, QSGD, TernGrad, fp4), the bucket-level selection beside;
#   lgc-bench step --device cuda: ResNet-50's DDP step over NCCL, one worker, batch 32 of 224x224,
#          at densities 0.1 % and 1 %, DDP's own allreduce (ddp) and the no-communication step beside;
#   experiments/gpu_pass_probe.py, gpu_topk_profile.py, gpu_hook_profile.py: where the top-k pass,
#          error feedback over top-k a bucket at once, and the DDP hook spend their time;
#   experiments/fused_passes_probe.py --device cuda: torch.compile's fused passes (Triton) against
#          the eager ones, compile time and break-even steps.
#   experiments/gpu_checks.sh [OUT]      (default outputs/gpu_checks; every log and JSON lands there)
set -uo pipefail
out=${1:-outputs/gpu_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
python -m pytest -q -p no:cacheprovider -rfE --tb=short tests/ddp/test_devices.py tests/ddp/test_gloo_devices.py \
  tests/ddp/test_hook.py tests/compressors \
  tests/bench/test_bench.py -k "cuda or gpu" > "$out/pytest.log" 2>&1
tail -1 "$out/pytest.log"
lgc-bench compressors --device cuda --json "$out/compressors.json" > "$out/compressors.md" 2>&1
grep "^|" "$out/compressors.md" | head -48
for density in 0.001 0.01; do
  lgc-bench step --device cuda --workers 1 --batch-size 32 --image-size 224 --density "$density" --steps 3 --rounds 3 \
    --methods ddp,none,torch_fp16,powersgd,topk,dgc,sbc,redsync,random_block,qsgd,terngrad,signsgd,fp4,chunked_topk,shared_topk_int8,sparseloco,demo \
    --json "$out/step_$density.json" > "$out/step_$density.md" 2>&1
  grep "^|" "$out/step_$density.md"
done
python experiments/gpu_pass_probe.py > "$out/pass_probe.md" 2>&1
tail -8 "$out/pass_probe.md"
python experiments/fused_passes_probe.py --device cuda --json "$out/fused_passes.json" > "$out/fused_passes.md" 2>&1
grep "^|" "$out/fused_passes.md"
python experiments/gpu_topk_profile.py > "$out/topk_profile.md" 2>&1
grep "^##" "$out/topk_profile.md"
python experiments/gpu_hook_profile.py > "$out/hook_profile.md" 2>&1
grep "^##" "$out/hook_profile.md"
