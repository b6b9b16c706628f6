#!/usr/bin/env bash
# The crossover table: for every method, the link bandwidth below which its step beats PyTorch's
# fp16 hook's, on ResNet-50 (ImageNet shapes, a GPU's 100 ms of compute) and on the comparison's
# models on their data (ResNet-8 and ResNet-20 on Fashion-MNIST, PSPNet on Fashion scenes; compute
# measured on this machine), at 4, 8 and 64 workers; from each method's codec time and collectives
# measured here (lgc-bench model's profiles) and the alpha-beta cost model, at the per-message
# latency fitted on the shaped network. Then the check against measurement: every method over a
# shaped network (Fashion-MNIST, ResNet-8, 4 workers, one seed, STEPS steps) at 100 Mbit/s and
# 1 Gbit/s, whether its measured step beats fp16's where the model says it does (12 of the methods).
#   1. lgc-bench network (needs root and iproute2): the measured steps and the fitted link.
#   2. lgc-bench model with the fitted latency: the tables (model.md), the plot (model.png).
#      With LATENCY_RECORD (an lgc-bench network record of the same setting) the model runs first,
#      at the latency fitted there, and the network's check after it.
#   3. experiments/one_message_tables.py check --write: crossover.md, the crossover table with the check
#      (and, for the committed records, the evidence page's block).
# Resumable: the network run skips what OUT/network/network.json.gz holds, the model reuses
# OUT/profiles.json. Needs a quiet machine (timings), about 45 min.
#   sudo experiments/crossover.sh [OUT]
set -euo pipefail
out=${1:-experiments/results/crossover}
methods="none,torch_fp16,powersgd,topk,dgc,sbc,redsync,random_block,qsgd,terngrad,signsgd,fp4,chunked_topk"
methods+=",shared_topk_int8,lgc_rar,lgc_ps,demo,none:delay=10;outer=sgd,sparseloco:delay=10"
methods+=",fp4:delay=10;outer=sgd;fragments=2;fragment_split=strided"
# The shaped network's methods: the per-step ones of the comparison and two local-step ones, DGC's
# warm-up and DeMo's learning rate as the comparison runs them.
network_methods="none,torch_fp16,powersgd,topk,dgc:steps_per_epoch=6,sbc,random_block,qsgd"
network_methods+=",shared_topk_int8,lgc_rar,none:delay=10;outer=sgd,sparseloco:delay=10"
network_check() {
  lgc-bench network --task fashion_mnist --workers 4 --bandwidth 100mbit,1gbit --seeds 0 --steps "${STEPS:-60}" \
    --eval-every "${STEPS:-60}" --methods "$network_methods" --out "$out/network"
}
mkdir -p "$out"
# The per-message latency: fitted on plain collectives over the shaped network at 100 Mbit/s, by
# LATENCY_RECORD (an lgc-bench network record, e.g. one_message_network's) or else by the check's run.
record=${LATENCY_RECORD:-$out/network/network.json.gz}
if [ -z "${LATENCY_RECORD:-}" ]; then network_check; fi
latency=$(python experiments/one_message_tables.py latency "$record" --setting "4 workers, 100mbit")
lgc-bench model --model resnet50,resnet8,resnet20,pspnet_small --workers 4,8,64 --bandwidth 100mbit,1gbit,10gbit \
  --latency "$latency" --methods "$methods" --profiles "$out/profiles.json" --out "$out"
if [ -n "${LATENCY_RECORD:-}" ]; then network_check; fi
python experiments/one_message_tables.py check "$out/model.json" "$out/network/network.json.gz" \
  --commit "$(git rev-parse --short HEAD)" --write
