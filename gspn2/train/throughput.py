"""The training loop's speed: images per second, step time, the share of time spent waiting for data, peak
GPU memory and the time left, per log interval and per epoch.

Times are host wall-clock times (``time.perf_counter``). The device is synchronised only where a figure is
read (:meth:`ThroughputMeter.interval`, :meth:`ThroughputMeter.epoch`), once per log interval and once per
epoch: between those points the host queues work ahead of the GPU as it would without the meter. Data wait
is the host time spent blocked on the loader (creating the epoch's iterator and every ``next``); over an
interval, data wait / wall time is the share of the step the input pipeline cost.
"""

from __future__ import annotations

import datetime
import math
import time

import torch

__all__ = ["TIMING_KEYS", "ThroughputMeter", "format_duration", "format_interval", "run_figures"]

#: The per-epoch keys :meth:`ThroughputMeter.epoch` adds to an epoch's record; they vary from run to run.
TIMING_KEYS = (
    "epoch_s",
    "steps_s",
    "eval_s",
    "img_per_s",
    "img_per_s_per_device",
    "step_s",
    "data_wait",
    "peak_mem_gb",
)


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (days spelled out by :class:`datetime.timedelta` when there are any)."""
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


class ThroughputMeter:
    """Speed of one rank's training steps.

    Args:
        device: where the model runs; on CUDA the peak memory is read and the device synchronised at
            the read points.
        images_per_step: images of one optimizer step over all ranks (the global batch).
        world_size: processes (GPUs) sharing the global batch.
    """

    def __init__(self, device: torch.device, images_per_step: int, world_size: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.images_per_step = images_per_step
        self.world_size = world_size
        self._epoch_start = self._interval_start = time.perf_counter()
        self._epoch_steps = self._interval_steps = 0
        self._epoch_wait = self._interval_wait = 0.0

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start_epoch(self) -> None:
        """Zero the epoch's and the interval's counters (and the CUDA peak memory statistic)."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._epoch_start = self._interval_start = self._now()
        self._epoch_steps = self._interval_steps = 0
        self._epoch_wait = self._interval_wait = 0.0

    def waited(self, seconds: float) -> None:
        """Count ``seconds`` the host spent blocked on the loader."""
        self._epoch_wait += seconds
        self._interval_wait += seconds

    def step(self) -> None:
        """Count one finished optimizer step (no synchronisation)."""
        self._epoch_steps += 1
        self._interval_steps += 1

    def _figures(self, steps: int, wall: float, wait: float) -> dict:
        img_per_s = steps * self.images_per_step / wall if wall > 0 else math.nan
        return {
            "img_per_s": img_per_s,
            "img_per_s_per_device": img_per_s / self.world_size,
            "step_s": wall / steps if steps else math.nan,
            "data_wait": wait / wall if wall > 0 else math.nan,
            "peak_mem_gb": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None,
        }

    def interval(self) -> dict:
        """The figures since the previous call (or the epoch's start), then start a new interval.

        Returns ``img_per_s`` (all ranks), ``img_per_s_per_device``, ``step_s``, ``data_wait`` (a
        fraction), ``peak_mem_gb`` (since the epoch's start; ``None`` off CUDA).
        """
        now = self._now()
        figures = self._figures(self._interval_steps, now - self._interval_start, self._interval_wait)
        self._interval_start, self._interval_steps, self._interval_wait = now, 0, 0.0
        return figures

    def epoch(self) -> dict:
        """The same figures over every step of the epoch so far, and ``steps_s``, their wall time."""
        wall = self._now() - self._epoch_start
        return {"steps_s": wall, **self._figures(self._epoch_steps, wall, self._epoch_wait)}


def format_interval(figures: dict, cuda: bool) -> str:
    """``1234.5 img/s (617.2/GPU) | step 0.104 s | data 3% | mem 9.81 GB`` (``mem n/a`` off CUDA)."""
    unit = "GPU" if cuda else "process"
    mem = figures["peak_mem_gb"]
    return (
        f"{figures['img_per_s']:.1f} img/s ({figures['img_per_s_per_device']:.1f}/{unit}) | "
        f"step {figures['step_s']:.3f} s | data {100 * figures['data_wait']:.0f}% | "
        f"mem {'n/a' if mem is None else f'{mem:.2f} GB'}"
    )


def run_figures(history: list[dict]) -> dict | None:
    """The epochs' figures over the whole run: images and steps over training time, the data wait share
    weighted by each epoch's training time, the highest peak memory. ``None`` without timed epochs."""
    timed = [h for h in history if h.get("steps_s") and math.isfinite(h.get("img_per_s", math.nan))]
    if not timed:
        return None
    wall = sum(h["steps_s"] for h in timed)
    peaks = [h["peak_mem_gb"] for h in timed if h.get("peak_mem_gb") is not None]
    img_per_s = sum(h["img_per_s"] * h["steps_s"] for h in timed) / wall
    return {
        "img_per_s": img_per_s,
        "img_per_s_per_device": sum(h["img_per_s_per_device"] * h["steps_s"] for h in timed) / wall,
        "step_s": wall / sum(h["steps_s"] / h["step_s"] for h in timed),
        "data_wait": sum(h["data_wait"] * h["steps_s"] for h in timed) / wall,
        "peak_mem_gb": max(peaks) if peaks else None,
    }
