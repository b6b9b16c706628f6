#!/usr/bin/env bash
# The scale comparison's cells on a lent GPU (one or more; the 4 workers share them over gloo, so
# the bytes are 4 GPUs' and the wall times are not a GPU's speed): the segmentation cell with the
# paper's PSPNet on a dilated ResNet-50 (model=pspnet) and the ResNet-20 IID cell, for dense, fp16,
# top-k and LGC-RAR, seeds in the protocol's order as far as the device's minutes allow. Resumable
# (a run stopped by the time limit goes on from its last checkpoint on the next call); records land
# in results/scale_gpu/CELL/METHOD/seedN/ (carry them back and commit them).
#   experiments/gpu_scale.sh [OUT]     (default outputs/scale_gpu)
set -uo pipefail
out=${1:-outputs/scale_gpu}
export PYTHONUNBUFFERED=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 2
here=$(dirname "$0")
python "$here/scale_comparison.py" --out "$out" --results "$here/results/scale_gpu" --cells seg4 \
  --methods dense fp16 topk lgc_rar --extra trainer=gpu model=pspnet
python "$here/scale_comparison.py" --out "$out" --results "$here/results/scale_gpu" --cells r20_iid4 \
  --methods dense fp16 topk lgc_rar --extra trainer=gpu
