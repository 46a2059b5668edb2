"""trainer.profile_steps=[first,last]: torch.profiler over those training steps, written to the
run directory as a Chrome/Perfetto trace and a table of the device's time by kernel kind.

The table answers the first question about a slow step: is the device busy (then which
kernels take the time) or waiting for the host (launches, Python, input)? `busy_frac` is the
kernels' time over the steps' wall time; far below 1 means the step is bound by the host, and
CUDA graphs (graph=compile graph.mode=reduce-overhead) or larger batches pay, not faster
kernels.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import torch

log = logging.getLogger("rapidformer")

# kernel name pattern -> kind, first match wins
KINDS = [("attention", r"flash|fmha|attention|sdpa|efficient_attention|varlen"),
         ("matmul", r"gemm|matmul|sm90_xmma|cutlass|cublas|nvjet|ampere_.*_s16816|sm80|"
                    r"aten::(add)?b?mm\b"),
         ("optimizer", r"adam|multi_tensor|foreach|fused_.*optim"),
         ("loss", r"cross_entropy|log_softmax|nll_loss"),
         ("communication", r"nccl|allreduce|all_gather|reduce_scatter"),
         # before "copy": inductor names a kernel by every op it fuses, so a layer norm that
         # ends in a cast to bf16 is `triton_red_fused__to_copy_...`, compute and not a copy
         ("fused elementwise", r"^triton_"),
         ("copy", r"memcpy|memset|copy_|cat_|Memcpy|Memset"),
         ("fused elementwise", r"fused"),
         ("other elementwise", r".")]


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE))


def kernel_summary(prof, device_type: str, steps: int, wall_s: float | None = None) -> dict:
    """The profiled steps' kernel time per step, by kind and for the top kernels (on a CPU:
    the aten ops' own CPU time). On a GPU, `regions` are the host-side events (compiled
    graphs, the optimizer step) with the device time of the kernels they launched: nested
    regions overlap, so they are not added up."""
    from torch.autograd import DeviceType

    kernels: dict[str, float] = {}
    regions: dict[str, float] = {}
    for event in prof.key_averages():
        if device_type == "cuda":
            # a host-side event's device time is its kernels' time again: kernels only; a
            # record_function's device-side twin (the optimizer step's) is a region, kept once
            # under its host-side event
            if getattr(event, "is_user_annotation", False) and event.device_type == DeviceType.CUDA:
                continue
            if event.device_type == DeviceType.CUDA and event.device_time_total > 0:
                kernels[event.key] = kernels.get(event.key, 0.0) + event.device_time_total
            elif event.device_type == DeviceType.CPU and event.device_time_total > 0:
                regions[event.key] = regions.get(event.key, 0.0) + event.device_time_total
        elif event.self_cpu_time_total > 0 and event.key.startswith("aten::"):
            kernels[event.key] = kernels.get(event.key, 0.0) + event.self_cpu_time_total
    total = sum(kernels.values()) or 1e-9
    by_kind: dict[str, float] = {}
    for name, us in kernels.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + us
    per_step = lambda us: round(us / 1000 / steps, 3)  # noqa: E731
    summary = {"steps": steps, "kernel_ms_per_step": round(total / 1000 / steps, 2)}
    if wall_s:
        summary["wall_ms_per_step"] = round(wall_s * 1000 / steps, 2)
        summary["busy_frac"] = round(total / 1e6 / wall_s, 3)
    summary["kinds"] = {k: {"ms_per_step": round(v / 1000 / steps, 2), "share": round(v / total, 4)}
                        for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    summary["top_kernels"] = [{"name": name[:120], "kind": kind_of(name),
                               "ms_per_step": per_step(us)}
                              for name, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:40]]
    if regions:
        summary["regions"] = [{"name": name[:120], "device_ms_per_step": per_step(us)}
                              for name, us in sorted(regions.items(), key=lambda kv: -kv[1])[:12]]
    return summary


class StepProfiler:
    """Started before step `first`, stopped after step `last` (the loop calls `before_steps`
    once and `step_done` after every step)."""

    def __init__(self, steps, run_dir: Path, rank: int, device: torch.device):
        self.first, self.last = (steps if steps else (None, None))
        self.out = Path(run_dir) / "profile"
        self.rank, self.device = rank, device
        self.prof = None
        self.started = 0.0
        self.seen = 0  # the last step taken

    def before_steps(self, done: int) -> None:
        """`done`: the steps taken before this run's loop (a resumed run's)."""
        if self.first is not None and done + 1 == self.first:
            self._start()
        elif self.first is not None and done >= self.first:
            log.warning("trainer.profile_steps=[%d, %d]: this run starts after step %d; "
                        "nothing is profiled", self.first, self.last, done)
            self.first = None

    def step_done(self, step: int) -> None:
        self.seen = step
        if self.prof is not None and step >= self.last:
            self._stop(step)
        elif self.first is not None and self.prof is None and step + 1 == self.first:
            self._start()

    def close(self) -> None:
        """The loop ended before `last` (its last step, a stop signal, early stopping): the
        steps recorded are written."""
        if self.prof is None:
            return
        if self.seen >= self.first:
            log.warning("trainer.profile_steps=[%d, %d]: the run ended at step %d; the steps "
                        "recorded are written", self.first, self.last, self.seen)
            self._stop(self.seen)
        else:
            self.prof.__exit__(None, None, None)
            self.prof = None

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.prof = torch.profiler.profile(activities=activities)
        self.prof.__enter__()
        self.started = time.perf_counter()

    def _stop(self, step: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        steps = step - self.first + 1
        summary = kernel_summary(prof, self.device.type, steps, wall)
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / f"trace_rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(trace))
        table = self.out / f"kernels_rank{self.rank}.json"
        table.write_text(json.dumps({"first": self.first, "last": step, **summary},
                                    indent=1) + "\n")
        self.first = None
        kinds = ", ".join(f"{k} {v['ms_per_step']}" for k, v in list(summary["kinds"].items())[:4])
        log.info("profile of steps %d-%d: %.2f ms of kernels per step in %.2f ms of wall time "
                 "(busy %.0f %%; %s ms); %s, %s", step - steps + 1, step,
                 summary["kernel_ms_per_step"], summary["wall_ms_per_step"],
                 100 * summary["busy_frac"], kinds, table, trace)
