#!/usr/bin/env bash
# Time to accuracy over a real shaped network on the task that separates methods: Fashion-MNIST,
# ResNet-8, 4 workers (each in its own network namespace, links shaped by tc) at 100 Mbit/s and
# 1 Gbit/s, seeds 0-2, every method trained STEPS steps and evaluated every 50 on the 10,000 test
# images: time to TARGET accuracy (0.86: at 100 Mbit/s 10 of the 13 methods reach it on every
# seed, where 0.88 is reached on every seed by 3) with its 95 % interval, as a multiple of the no-communication
# bound (dense's steps to the target at compute-only step time), beside step time and wire bytes.
# The learning rate follows a cosine to 0 over the steps, as lgc-train anneals.
# Methods: dense, PyTorch's fp16 and PowerSGD hooks, DGC (its 4 warm-up densities over 2.4 % of
# the run, 6 steps each, as the comparison scales the paper's 4 of 160 epochs), shared-index int8
# (shared_topk_int8), SBC with delay 4 (and with every parameter through it), DiLoCo H = 10,
# SparseLoCo H = 10, DeMo, LGC-RAR, and LGC-RAR lean and shared-index int8 with delay 4 (every
# parameter through the codec).
# Resumable: lgc-bench network keeps every measurement in OUT/network.json.gz as it arrives and a
# rerun skips what is there. Needs root and iproute2, and a quiet machine (timings).
#   sudo experiments/fashion_mnist_network.sh [OUT]
#   STEPS=600 TARGET=0.84 BANDWIDTHS=100mbit sudo experiments/fashion_mnist_network.sh
# Needs the dataset: apt-get install dataset-fashion-mnist (or FASHION_MNIST_ROOT).
set -euo pipefail
out=${1:-experiments/results/fashion_mnist_network}
methods="none,torch_fp16,powersgd,dgc:steps_per_epoch=6,shared_topk_int8,sbc:delay=4,sbc:delay=4;min_numel=0"
methods+=",none:delay=10;outer=sgd,sparseloco:delay=10,demo:lr=0.003,lgc_rar"
methods+=",shared_topk_int8:delay=4;min_numel=0"
methods+=",lgc_rar:delay=4;min_numel=0;training.codec=linear;stages.warmup_steps=1;stages.ae_steps=20;latent_dtype=int8;leaders.index_coding=golomb;leaders.value_order=position"
lgc-bench network --task fashion_mnist --workers 4 --bandwidth "${BANDWIDTHS:-100mbit,1gbit}" \
  --seeds "${SEEDS:-0,1,2}" --steps "${STEPS:-1000}" --eval-every 50 --target "${TARGET:-0.86}" \
  --methods "$methods" --out "$out"
