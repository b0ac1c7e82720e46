"""The vLLM scheduler hook's cost per engine step (``zeus_async.integrations.vllm_scheduler``).

A real vLLM ``Scheduler`` (built on CPU as the tests build it: ``tests/integrations/
test_vllm_scheduler.py``) with 256 requests decoding runs 200 steps (``schedule`` +
``update_from_output``) with and without the hook feeding a ``RequestMeter("steps")``,
alternating; then the feed's own time per step (``SchedulerFeed.on_schedule`` +
``on_update``), which is what the hook adds to the engine's step.

Needs vLLM (``.ci/run`` installs it). Run: ``.venv/bin/python bench/inference/bench_vllm_hook.py``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integrations"))

import test_vllm_scheduler as t

from zeus_async.inference import RequestMeter
from zeus_async.integrations import vllm as plugin
from zeus_async.integrations import vllm_scheduler as hook


def run(with_hook: bool) -> float:
    """Microseconds per step, schedule + update, 256 requests decoding."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    plugin.reset()
    meter = RequestMeter("steps", gpus=[3], max_edge_delay_s=5.0)
    if with_hook:
        plugin.configure(meter, gpus=[3])
    vc = t.make_config(batched=8192)
    vc.scheduler_config.max_num_seqs = 256
    vc.cache_config.num_gpu_blocks = 4096
    cls = vc.scheduler_config.get_scheduler_cls()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
    )
    s = cls(
        vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
        log_stats=False, block_size=16, hash_block_size=16,
    )  # fmt: skip
    for i in range(256):
        t.add(s, f"r{i}", 16, 10_000)
    out = s.schedule()
    s.update_from_output(out, t.runner_output(s, out))
    n, total = 200, 0.0
    for _ in range(n):
        a = time.perf_counter()
        out = s.schedule()
        mro = t.runner_output(s, out)
        b = time.perf_counter()
        s.update_from_output(out, mro)
        total += (b - a) + (time.perf_counter() - b)
    assert len(out.num_scheduled_tokens) == 256
    return total / n * 1e6


def feed_alone() -> float:
    """Microseconds per step spent in the hook's feed."""
    acc = [0.0, 0]
    on_schedule, on_update = hook.SchedulerFeed.on_schedule, hook.SchedulerFeed.on_update

    def timed_schedule(self: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        on_schedule(self, *args)
        acc[0] += time.perf_counter() - t0

    def timed_update(self: Any, *args: Any) -> None:
        t0 = time.perf_counter()
        on_update(self, *args)
        acc[0] += time.perf_counter() - t0
        acc[1] += 1

    hook.SchedulerFeed.on_schedule = timed_schedule  # type: ignore[method-assign]
    hook.SchedulerFeed.on_update = timed_update  # type: ignore[method-assign]
    try:
        run(True)
    finally:
        hook.SchedulerFeed.on_schedule = on_schedule  # type: ignore[method-assign]
        hook.SchedulerFeed.on_update = on_update  # type: ignore[method-assign]
    return acc[0] / acc[1] * 1e6


def main() -> None:
    for with_hook in (False, True, False, True):
        label = "with the hook" if with_hook else "plain vLLM"
        print(f"{label:<14} {run(with_hook):8.0f} us per step (schedule + update, 256 decoding)")
    print(f"{'feed alone':<14} {feed_alone():8.0f} us per step (RequestMeter('steps'))")


if __name__ == "__main__":
    main()
