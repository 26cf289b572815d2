"""CUDA-event timing shared by the benchmarks."""

import statistics
import time

import torch


def time_ms(fn, iters=5, warmup=2):
    """Median of `iters` CUDA-event timed calls after `warmup` calls. A call slower than half a
    second is warmed up once and timed twice at most, and timing stops after 20 s."""
    for w in range(warmup):
        t0 = time.monotonic()
        fn()
        torch.cuda.synchronize()
        if time.monotonic() - t0 > 0.5:
            iters = min(iters, 2)
            break
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if sum(times) > 20_000:  # a slow call: the median of what fits in 20 s
            break
    return statistics.median(times)
