"""What the PFO server charges a tenant's memory limit with, against what it really holds.

For each case, ranks are decoded as the server decodes them, and a ``FrontierPlanner`` (its
3D-parallel form for data-parallel ranks) builds its first schedules, all under tracemalloc.
"Charged" is what the server counts against ``max_client_mib`` for those ranks and schedules
(``server._footprint``, ``server._schedule_footprint``); "held" is what tracemalloc still
sees allocated afterwards. The charge is meant as an upper estimate: held / charged <= 1.

Run: ``.venv/bin/python bench/pfo/bench_pfo_memory.py``
"""

from __future__ import annotations

import gc
import tracemalloc

import msgspec

from zeus_async.optimizer.pipeline import server
from zeus_async.optimizer.pipeline.messages import JobInfo, RankInfo
from zeus_async.optimizer.pipeline.schedulers import FrontierPlanner, make_3d_parallel
from zeus_async.optimizer.pipeline.settings import PfoSettings

CASES = (  # ranks, clocks per rank, microbatches, parallelism
    (5000, 1, 8, "pp"),
    (5000, 1, 8, "dp"),
    (200, 1024, 8, "pp"),
    (2000, 1, 64, "pp"),
    (500, 1, 256, "pp"),
)


def measure(n: int, clocks: int, microbatches: int, kind: str) -> tuple[float, float]:
    dp = kind == "dp"
    info = JobInfo(pp_degree=1 if dp else n, dp_degree=n if dp else 1, tp_degree=1, world_size=n)
    freqs = list(range(2024, 2024 - clocks, -1))
    gc.collect()
    tracemalloc.start()
    ranks = [
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(
                RankInfo(
                    rank=r,
                    dp_rank=r if dp else 0,
                    pp_rank=0 if dp else r,
                    tp_rank=0,
                    available_frequencies=freqs,
                )
            ),
            type=RankInfo,
        )
        for r in range(n)
    ]
    table = {r.rank: r for r in ranks}  # the job's rank table
    charged = sum(server._footprint(r) for r in table.values())
    cls = make_3d_parallel(FrontierPlanner) if dp else FrontierPlanner
    args = {"num_microbatches": microbatches}
    settings = PfoSettings(dump_data=False, scheduler="FrontierPlanner", scheduler_args=args)
    scheduler = cls(info, ranks, settings, num_microbatches=microbatches)
    schedules = scheduler.next_schedule()
    charged += sum(server._schedule_footprint(s) for s in schedules)
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return charged / 2**20, held / 2**20


def main() -> None:
    print(f"{'ranks':>6}{'clocks':>8}{'microbatches':>14}{'kind':>6}{'charged MiB':>13}"
          f"{'held MiB':>10}{'held/charged':>14}")  # fmt: skip
    for n, clocks, mb, kind in CASES:
        charged, held = measure(n, clocks, mb, kind)
        print(f"{n:>6}{clocks:>8}{mb:>14}{kind:>6}{charged:>13.2f}{held:>10.2f}"
              f"{held / charged:>14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
