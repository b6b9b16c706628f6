"""A probe, not a benchmark of the package: where the error-feedback top-k pass spends its time on a GPU.

    python experiments/gpu_pass_probe.py      # on a machine with a CUDA device (the CPU works, slowly)

Candidates, each on ResNet-50's 161 tensors (25,557,032 fp32 entries), density 0.001, timed by CUDA
events in 20 interleaved rounds (medians):
  fp16_rt      per-tensor fp16 round trip into reused buffers (the benchmarks' reference)
  lgc_topk     lgc's ErrorFeedback(TopKCompressor) compress + decompress per tensor, as installed
  torch_topk   per tensor: acc += g; torch.topk(|acc|, k); gather; zero; scatter into out
  flat_eager   the bucket as one flat tensor: acc += g (one kernel), then each tensor's block maxima
               (128 entries) over its own view: the first half of a bucket-level top-k, eager
  flat_comp    the same first half as one torch.compile'd function: the add, a copy into a buffer
               padding every tensor to whole blocks, and the block maxima (the first call compiles)
The two flat candidates stop before the selection (top-k of the maxima, the candidates' search).
"""

import statistics
import time

import torch

from lgc.bench.compressors import resnet50_numels
from lgc.compressors import ErrorFeedback, TopKCompressor

CUDA = torch.cuda.is_available()
dev = torch.device("cuda" if CUDA else "cpu")
numels = resnet50_numels()
total = sum(numels)
gen = torch.Generator(device=dev).manual_seed(0)
flat_g = torch.randn(total, device=dev, generator=gen)
grads = list(flat_g.split(numels))
density = 0.001
ks = [max(1, round(n * density)) for n in numels]

half = [torch.empty(n, device=dev, dtype=torch.float16) for n in numels]
outs = [torch.empty(n, device=dev) for n in numels]


def fp16_rt():
    for g, h, o in zip(grads, half, outs, strict=True):
        h.copy_(g)
        o.copy_(h)


ef = ErrorFeedback(TopKCompressor(density))


def lgc_topk():
    for i, g in enumerate(grads):
        p = ef.compress(g, str(i))
        outs[i].copy_(ef.decompress(p))


accs = [torch.zeros(n, device=dev) for n in numels]


def torch_topk():
    for g, a, o, k in zip(grads, accs, outs, ks, strict=True):
        a.add_(g)
        idx = torch.topk(a.abs(), k, sorted=False).indices
        v = a[idx]
        a[idx] = 0
        o.zero_()
        o[idx] = v


flat_acc = torch.zeros(total, device=dev)
BLOCK = 128
# Segment layout: every tensor padded to whole blocks in a padded flat buffer.
padded = [(n + BLOCK - 1) // BLOCK * BLOCK for n in numels]
pad_total = sum(padded)
pad_buf = torch.zeros(pad_total, device=dev)
src_index = torch.cat(
    [
        torch.arange(n, device=dev) + off
        for n, off in zip(numels, [0, *torch.tensor(padded).cumsum(0)[:-1].tolist()], strict=True)
    ]
)


def flat_eager():
    flat_acc.add_(flat_g)
    accs_view = flat_acc.split(numels)
    maxima = []
    for a in accs_view:
        n = a.numel() // BLOCK * BLOCK
        if n:
            maxima.append(a[:n].view(-1, BLOCK).abs().amax(1))
    return maxima


def _pass(acc, g, pad, src):
    acc.add_(g)
    pad.index_copy_(0, src, acc)
    return pad.view(-1, BLOCK).abs().amax(1)


compiled = torch.compile(_pass)


def flat_comp():
    compiled(flat_acc, flat_g, pad_buf, src_index)


def run(fn):
    if not CUDA:
        t0 = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - t0), 1000 * (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), 1000 * (time.perf_counter() - t0)


t = time.perf_counter()
flat_comp()
CUDA and torch.cuda.synchronize()
print(f"torch.compile of the flat pass: first call {time.perf_counter() - t:.1f} s")
cands = {
    "fp16_rt": fp16_rt,
    "lgc_topk": lgc_topk,
    "torch_topk": torch_topk,
    "flat_eager": flat_eager,
    "flat_comp": flat_comp,
}
for fn in cands.values():
    for _ in range(3):
        fn()
times = {name: [] for name in cands}
for _ in range(20 if CUDA else 2):
    for name, fn in cands.items():
        times[name].append(run(fn))
ref = statistics.median(t for t, _ in times["fp16_rt"])
where = torch.cuda.get_device_name() if CUDA else dev
print(f"{where}, torch {torch.__version__}, {total:,} elements in {len(numels)} tensors")
print("| candidate | GPU ms (events) | host wall ms | x fp16_rt |")
for name, ts in times.items():
    gpu = statistics.median(t for t, _ in ts)
    wall = statistics.median(w for _, w in ts)
    print(f"| {name} | {gpu:.3f} | {wall:.3f} | {gpu / ref:.2f} |")
