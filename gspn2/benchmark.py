"""Timing helper shared by the benchmark scripts (scripts/bench_models.py, scripts/bench_fast_path.py)."""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["median_ms"]


def median_ms(fn: Callable[[], object], warmup: int, iters: int, cuda: bool | None = None) -> float:
    """Median milliseconds of one call of ``fn`` after ``warmup`` untimed calls.

    On CUDA (``cuda=None``: whenever a GPU is present) each call is timed with a pair of CUDA events on the
    current stream and synchronised, so the figure is device time including the launches; otherwise with
    ``time.perf_counter``.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"`warmup` must be >= 0 and `iters` >= 1, got {warmup} and {iters}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]
