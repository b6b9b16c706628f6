"""A probe, not a benchmark of the package: where error feedback over top-k spends a bucket's time on a GPU.

    python experiments/gpu_topk_profile.py      # on a machine with a CUDA device (the CPU works, slowly)

ResNet-50's 161 tensors (25,557,032 fp32 entries) as the slices of one bucket, density 0.001;
ErrorFeedback(TopKCompressor) encodes the bucket (compress_many) and decodes the sum into the
bucket's slices (aggregate_many), tensor by tensor and as one flat, and the hook's step-guard look
at the bucket (bucket_maxima) runs beside. After two untimed steps, torch.profiler records 5 steps
of each; the tables list the operators by their own CUDA time and by their own host time, and
the host-device synchronizations per step (a synchronizing copy or a stream synchronize each).
"""

import torch
from torch.profiler import ProfilerActivity, profile

from lgc.bench.compressors import resnet50_numels
from lgc.compressors import ErrorFeedback, TopKCompressor
from lgc.ddp.exchange import Segment
from lgc.ddp.hook import bucket_maxima

CUDA = torch.cuda.is_available()
dev = torch.device("cuda" if CUDA else "cpu")
numels = resnet50_numels()
keys = [f"t{i}" for i in range(len(numels))]
bucket = torch.randn(sum(numels), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
grads = list(bucket.split(numels))
outs = list(torch.empty_like(bucket).split(numels))
offsets = [0]
for n in numels[:-1]:
    offsets.append(offsets[-1] + n)
segments = tuple(Segment(k, o, n, True) for k, o, n in zip(keys, offsets, numels, strict=True))
STEPS = 5


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def run(name: str, step) -> None:
    for _ in range(2):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        sync()
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    copies = sum(e.count for e in events if e.key in ("cudaMemcpyAsync", "cudaMemcpy"))
    print(f"\n## {name}: per step {syncs / STEPS:.1f} synchronizations, {copies / STEPS:.1f} memcpy calls")
    sort = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=14, max_name_column_width=40))
    if CUDA:
        print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40))


for bucketed in (False, True):
    ef = ErrorFeedback(TopKCompressor(0.001), bucketed=bucketed)

    def step(ef=ef) -> None:
        payloads = ef.compress_many(grads, keys)
        ef.aggregate_many([[p] for p in payloads], outs)

    run(f"top-k + error feedback, {'one flat' if bucketed else 'tensor by tensor'}", step)
run("the step guard's look (bucket_maxima)", lambda: bucket_maxima(bucket, segments))
