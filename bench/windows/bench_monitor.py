"""Measurement windows: zeus_async ``Monitor`` vs Zeus 0.16 ``ZeusMonitor``, side by side.

Both measure the same simulated GPUs (the simulator installed as ``pynvml`` in this process for
Zeus, and the same configuration in our monitor's sampler process: the model is a function of
the wall clock, so both see identical GPUs; every NVML call costs 10 µs of CPU with the GIL
released, like a ctypes call), with ``sync_execution=False``:

1. ``cost``: wall time of one ``begin_window`` + ``end_window`` pair on the caller's thread.
2. ``accuracy``: |measured - true| energy per window on a square-wave workload, for windows
   of 20 ms, 50 ms, 200 ms, 1 s and 10 s, both monitors measuring the same windows (Zeus with
   ``approx_instant_energy=True``). The truth is the simulator's exact integral over each
   monitor's own window edges.
3. ``training``: a small torch MLP training loop on CPU (~50 ms steps), one window per step,
   8 simulated GPUs sampled at 100 Hz with publishing and recording on: step time vs no monitor.
5. ``contention`` (not in the default parts): the same training step beside a process that
   only burns as much CPU as the sampler process does (16 % of a core): the cost of sharing
   this machine's CPUs, with no monitor at all.
4. ``background``: the CPU the monitor spends beside the caller's own thread, same setup as
   ``training`` with a 40 ms sleep for a step: the training process's other threads (the
   sampler process's I/O thread) and the sampler process, idle (no window) and with one window
   per step (scheduler run time where Linux gives it), the I/O thread's wake-ups per second,
   and begin+end on the caller's thread after each 40 ms sleep (cold caches).

Run: ``bench/.venv/bin/python bench/windows/bench_monitor.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import SquareWorkload
from zeus_async.testing import sim_pynvml

LATENCY_S = 10e-6


_CONFIG: list[SimConfig] = []


def install_sim(num_gpus: int, workload: Any) -> Any:
    """Install the simulator as ``pynvml`` here (for Zeus); our monitor's sampler process
    builds the same node from the same config (the model is a function of wall time)."""
    config = SimConfig(num_gpus=num_gpus, call_latency_s=LATENCY_S, workload=workload, seed=11)
    node = sim_pynvml.install(config=config)
    sim_pynvml.install_as_pynvml()
    _CONFIG[:] = [config]
    return node


def zeus_monitor(gpus: int) -> Any:
    logging.getLogger("zeus").setLevel(logging.ERROR)
    from zeus.monitor import ZeusMonitor

    return ZeusMonitor(gpu_indices=list(range(gpus)), cpu_indices=[], approx_instant_energy=True)


def our_monitor(gpus: int, **kw: Any) -> Any:
    from zeus_async import Monitor

    return Monitor(
        gpu_indices=list(range(gpus)),
        cpu_indices=[],
        backend="sim",
        sim_config=_CONFIG[0],
        sync_execution_with=None,
        **kw,
    )


def bench_cost(n: int) -> dict[str, float]:
    install_sim(4, SquareWorkload(period_s=0.5))
    zm, om = zeus_monitor(4), our_monitor(4)
    out: dict[str, float] = {}
    try:
        for name, begin, end in (
            ("zeus", zm.begin_window, zm.end_window),
            ("ours", om.begin_window, om.end_window),
        ):
            samples = []
            for i in range(n):
                t = time.perf_counter()
                begin(f"c{i}", sync_execution=False)
                end(f"c{i}", sync_execution=False)
                samples.append(time.perf_counter() - t)
                time.sleep(0.001)
            out[name] = statistics.median(samples) * 1e6
    finally:
        om.close()
    return out


def bench_accuracy(plan: list[tuple[float, int]]) -> dict[str, dict[str, float]]:
    square = SquareWorkload(period_s=0.37, duty=0.5, high=1.0, low=0.1)
    node = install_sim(4, square)
    zm, om = zeus_monitor(4), our_monitor(4)
    rng = random.Random(3)
    errors: dict[str, dict[str, list[float]]] = {}
    try:
        for length, count in plan:
            key = f"{length * 1e3:g} ms" if length < 1 else f"{length:g} s"
            errs = errors.setdefault(key, {"zeus": [], "ours": [], "zeus_rel": [], "ours_rel": []})
            pending = []
            for i in range(count):
                time.sleep(rng.uniform(0.0, 0.1))
                name = f"{key}-{i}"
                z0a = time.time_ns()
                zm.begin_window(name, sync_execution=False)
                z0b = time.time_ns()
                om.begin_window(name, sync_execution=False)
                time.sleep(length)
                ours = om.end_window(name, sync_execution=False)
                z1a = time.time_ns()
                zres = zm.end_window(name, sync_execution=False)
                z1b = time.time_ns()
                pending.append((ours, zres, (z0a + z0b) // 2, (z1a + z1b) // 2))
            for ours, zres, z0, z1 in pending:
                m = ours.wait(timeout=5)
                for gpu in range(4):
                    t_o = node.truth_energy_j(gpu, m.start_ns, m.end_ns)
                    t_z = node.truth_energy_j(gpu, z0, z1)
                    e_o = abs(m.gpu_energy_j[gpu] - t_o)
                    e_z = abs(zres.gpu_energy[gpu] - t_z)
                    errs["ours"].append(e_o)
                    errs["zeus"].append(e_z)
                    errs["ours_rel"].append(e_o / t_o)
                    errs["zeus_rel"].append(e_z / t_z)
    finally:
        om.close()
    return {
        k: {
            "n": len(v["ours"]),
            "zeus_mae_j": statistics.fmean(v["zeus"]),
            "ours_mae_j": statistics.fmean(v["ours"]),
            "zeus_mape": statistics.fmean(v["zeus_rel"]),
            "ours_mape": statistics.fmean(v["ours_rel"]),
        }
        for k, v in errors.items()
    }


def make_training_step() -> Callable[[], None]:
    """One step of a small MLP on CPU, single-threaded (~40-50 ms on the CI VM)."""
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(1536, 512), torch.randint(0, 10, (1536,))

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def bench_training(steps: int, rounds: int, publish: bool = True) -> dict[str, Any]:
    install_sim(8, SquareWorkload(period_s=0.5))
    step = make_training_step()

    for _ in range(10):
        step()
    zm = zeus_monitor(8)  # no background work on Volta+: it only reads counters at edges
    tmp = tempfile.mkdtemp(prefix="zeus-async-bench-")

    def phase(mode: str) -> list[float]:
        pub: dict[str, Any] = {"publish": "tcp://127.0.0.1:0"} if publish else {}
        pub["record"] = os.path.join(tmp, "training.zarc")
        om = our_monitor(8, **pub) if mode == "ours" else None
        out = []
        try:
            for _ in range(5):  # untimed: let a just-started sampler settle (all modes alike)
                step()
            for i in range(steps):
                t = time.perf_counter()
                if om is not None:
                    om.begin_window(f"s{i}", sync_execution=False)
                    step()
                    om.end_window(f"s{i}", sync_execution=False)
                elif mode == "zeus":
                    zm.begin_window(f"s{i}", sync_execution=False)
                    step()
                    zm.end_window(f"s{i}", sync_execution=False)
                else:
                    step()
                out.append(time.perf_counter() - t)
        finally:
            if om is not None:
                om.close()
        return out

    # "none_b" is a second, identical no-monitor group: its difference from "none" is the
    # noise floor of this measurement on this machine (an A/A test).
    times: dict[str, list[float]] = {"none": [], "ours": [], "zeus": [], "none_b": []}
    orders = [
        ("none", "ours", "zeus", "none_b"),
        ("zeus", "none_b", "none", "ours"),
        ("ours", "none", "none_b", "zeus"),
        ("none_b", "zeus", "ours", "none"),
    ]
    # Slowdowns are computed within each round (all four phases adjacent in time, so slow
    # drifts of this VM's speed cancel) and the median over rounds is reported.
    per_round: dict[str, list[float]] = {"ours": [], "zeus": [], "none_b": []}
    for r in range(rounds):
        round_med: dict[str, float] = {}
        for mode in orders[r % 4]:
            phase_times = phase("none" if mode == "none_b" else mode)
            times[mode].extend(phase_times)
            round_med[mode] = statistics.median(phase_times)
        for mode in per_round:
            per_round[mode].append(round_med[mode] / round_med["none"] - 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_ms_none": med["none"] * 1e3,
        "step_ms_ours": med["ours"] * 1e3,
        "step_ms_zeus": med["zeus"] * 1e3,
        "slowdown_ours": statistics.median(per_round["ours"]),
        "slowdown_ours_ci": _bootstrap_median_ci(per_round["ours"]),
        "slowdown_zeus_ci": _bootstrap_median_ci(per_round["zeus"]),
        "aa_noise_ci": _bootstrap_median_ci(per_round["none_b"]),
        "slowdown_zeus": statistics.median(per_round["zeus"]),
        "aa_noise": statistics.median(per_round["none_b"]),
        "steps_per_mode": float(len(times["none"])),
        "rounds": float(rounds),
    }


def bench_gil(rounds: int) -> dict[str, float]:
    """How much a background Python thread that holds the GIL for a given share of the time
    slows the same training step (no monitor at all): the mechanism behind in-process
    samplers' slowdown."""
    import threading

    step = make_training_step()

    def busy(stop: threading.Event, hold_s: float) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() < t + hold_s:
                pass
            time.sleep(max(0.0, 0.01 - (time.perf_counter() - t)))

    holds = {"none": 0.0, "0.1 ms per 10 ms": 1e-4, "0.5 ms per 10 ms": 5e-4}
    per_round: dict[str, list[float]] = {k: [] for k in holds}
    for _ in range(rounds):
        med: dict[str, float] = {}
        for name, hold in holds.items():
            stop = threading.Event()
            thread = threading.Thread(target=busy, args=(stop, hold)) if hold else None
            if thread is not None:
                thread.start()
            times = []
            for _ in range(15):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            stop.set()
            if thread is not None:
                thread.join()
            med[name] = statistics.median(times)
        for name in holds:
            per_round[name].append(med[name] / med["none"] - 1)
    return {name: statistics.median(v) for name, v in per_round.items() if name != "none"}


_BURNER = """
import sys, time
share, period = float(sys.argv[1]), 0.01
while True:
    t = time.perf_counter()
    while time.perf_counter() < t + share * period:
        pass
    time.sleep(max(0.0, period - (time.perf_counter() - t)))
"""


def bench_contention(rounds: int, share: float) -> dict[str, Any]:
    """Slowdown of the same training step beside a separate process that only burns
    ``share`` of a core (in 10 ms cycles, like a 100 Hz sampler) and does nothing else: what
    sharing this machine's CPUs costs by itself, with no monitor and no GIL involved."""
    step = make_training_step()
    for _ in range(10):
        step()
    per_round: list[float] = []
    for r in range(rounds):
        med: dict[str, float] = {}
        for mode in ("none", "burner") if r % 2 == 0 else ("burner", "none"):
            burner = None
            if mode == "burner":
                burner = subprocess.Popen([sys.executable, "-c", _BURNER, str(share)])
                time.sleep(0.5)
            try:
                for _ in range(5):
                    step()
                times = []
                for _ in range(20):
                    t = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t)
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
            med[mode] = statistics.median(times)
        per_round.append(med["burner"] / med["none"] - 1)
    return {
        "share": share,
        "slowdown": statistics.median(per_round),
        "slowdown_ci": _bootstrap_median_ci(per_round),
        "rounds": rounds,
    }


def _bootstrap_median_ci(values: list[float], n: int = 4000) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``values`` (seeded: reruns agree)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


def _run_ns(pid: int | str, skip_tid: int | None = None) -> int | None:
    """CPU time (ns) of every thread of process ``pid`` but ``skip_tid``, from the scheduler's
    own accounting (``/proc/PID/task/TID/schedstat``; ``None`` where there is none). Finer
    than ``user + system`` times, which count 10 ms ticks."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        if skip_tid is not None and int(tid) == skip_tid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total


def bench_background(seconds: float) -> dict[str, float]:
    """CPU share (of one core) of the parent's non-caller threads and of the sampler process,
    and the parent I/O thread's wake-ups per second."""
    import psutil

    install_sim(8, SquareWorkload(period_s=0.5))
    tmp = tempfile.mkdtemp(prefix="zeus-async-bench-")
    me = psutil.Process()
    main_tid = threading.get_native_id()
    precise = _run_ns("self") is not None

    def cpu() -> tuple[float, float]:
        if precise:
            kids_ns = [_run_ns(k.pid) for k in me.children(recursive=True)]
            others_ns = _run_ns("self", skip_tid=main_tid)
            assert others_ns is not None
            return others_ns / 1e9, sum(k or 0 for k in kids_ns) / 1e9
        others = sum(t.user_time + t.system_time for t in me.threads() if t.id != main_tid)
        kids = sum(sum(k.cpu_times()[:2]) for k in me.children(recursive=True))
        return others, kids

    out: dict[str, float] = {"precise_cpu": float(precise)}
    om = our_monitor(8, publish="tcp://127.0.0.1:0", record=os.path.join(tmp, "bg.zarc"))
    proc = om._process
    try:
        time.sleep(1.0)  # let the sampler settle
        for mode in ("idle", "window per 40 ms step"):
            (p0, k0), t0 = cpu(), time.perf_counter()
            w0 = proc.io_wakeups if proc is not None else 0
            i = 0
            edges_ns: list[int] = []
            while time.perf_counter() - t0 < seconds:
                if mode == "idle":
                    time.sleep(0.04)
                    continue
                c0 = time.perf_counter_ns()
                om.begin_window(f"s{i}", sync_execution=False)
                c1 = time.perf_counter_ns()
                time.sleep(0.04)
                c2 = time.perf_counter_ns()
                om.end_window(f"s{i}", sync_execution=False)
                edges_ns.append(c1 - c0 + time.perf_counter_ns() - c2)
                i += 1
            if edges_ns:
                out["edges_us_after_step"] = statistics.median(edges_ns) / 1e3
            (p1, k1), wall = cpu(), time.perf_counter() - t0
            out[f"parent_threads:{mode}"] = (p1 - p0) / wall
            out[f"sampler_process:{mode}"] = (k1 - k0) / wall
            if proc is not None:
                out[f"io_wakeups_per_s:{mode}"] = (proc.io_wakeups - w0) / wall
            out[f"steps_per_s:{mode}"] = i / wall
    finally:
        om.close()
    return out


def run_part(name: str, quick: bool, rounds: int | None = None) -> dict[str, Any]:
    if name == "contention":
        return {"contention": bench_contention(rounds or (8 if quick else 20), 0.16)}
    if name == "background":
        return {"background": bench_background(4.0 if quick else 15.0)}
    if name == "gil":
        return {"gil": bench_gil(4 if quick else 10)}
    if name == "training-nopub":
        return {"training": bench_training(20, rounds or (8 if quick else 20), publish=False)}
    if name == "cost":
        return {"cost_us": bench_cost(50 if quick else 300)}
    if name == "accuracy":
        plan = [(0.02, 40), (0.05, 30), (0.2, 20), (1.0, 8), (10.0, 3)]
        if quick:
            plan = [(0.02, 10), (0.05, 8), (0.2, 5), (1.0, 2)]
        return {"accuracy": bench_accuracy(plan)}
    if name == "training":
        return {"training": bench_training(20, rounds or (8 if quick else 20))}
    raise SystemExit(f"unknown part {name!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer windows (a smoke run)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--parts", default="cost,accuracy,training")
    parser.add_argument(
        "--rounds", type=int, default=None, help="training rounds (default 20; 8 with --quick)"
    )
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:  # one part in this (fresh) process: Zeus caches GPU handles process-wide
        part = run_part(args.only, args.quick, args.rounds)
        print(json.dumps(part))
        return 0
    results: dict[str, Any] = {}
    for name in args.parts.split(","):
        cmd = [sys.executable, __file__, "--only", name] + (["--quick"] if args.quick else [])
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"part {name} failed:\n{proc.stderr[-3000:]}")
        results.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    parts = args.parts.split(",")
    if "cost" in parts:
        cost = results["cost_us"]
        print("\n| begin+end, 4 GPUs, sync off | median µs |\n|---|---:|")
        print(f"| Zeus 0.16 ZeusMonitor | {cost['zeus']:.1f} |")
        print(f"| zeus_async Monitor | {cost['ours']:.1f} |")
        print(f"\nratio ours/Zeus: {cost['ours'] / cost['zeus']:.3f}x (target <= 0.25x)")
    if "accuracy" in parts:
        acc = results["accuracy"]
        header = "| window | windows x GPUs | Zeus MAE J | ours MAE J | ratio | Zeus MAPE "
        print("\n" + header + "| ours MAPE |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for key, r in acc.items():
            print(
                f"| {key} | {r['n']} | {r['zeus_mae_j']:.3f} | {r['ours_mae_j']:.3f} "
                f"| {r['ours_mae_j'] / r['zeus_mae_j']:.3f}x | {r['zeus_mape'] * 100:.2f} % "
                f"| {r['ours_mape'] * 100:.2f} % |"
            )
    if "training" in parts or "training-nopub" in parts:
        tr = results["training"]
        print("\n| training loop, window per step, 8 GPUs | median step ms | slowdown | 95 % CI |")
        print("|---|---:|---:|---:|")

        def ci(key: str) -> str:
            lo, hi = tr[key]
            return f"{lo * 100:+.2f} .. {hi * 100:+.2f} %"

        print(f"| no monitor | {tr['step_ms_none']:.2f} | | |")
        print(
            f"| zeus_async Monitor | {tr['step_ms_ours']:.2f} | {tr['slowdown_ours'] * 100:.2f} % "
            f"| {ci('slowdown_ours_ci')} |"
        )
        zeus_row = f"| Zeus 0.16 ZeusMonitor | {tr['step_ms_zeus']:.2f} "
        print(zeus_row + f"| {tr['slowdown_zeus'] * 100:.2f} % | {ci('slowdown_zeus_ci')} |")
        print(
            f"| A/A control: no monitor again (noise floor) | | {tr['aa_noise'] * 100:.2f} % "
            f"| {ci('aa_noise_ci')} |"
        )
        print(
            f"\n{tr['steps_per_mode']:.0f} steps per mode in {tr['rounds']:.0f} rounds of "
            "20-step phases; slowdown = median over rounds of the in-round ratio"
        )
    if "background" in parts:
        bg = results["background"]
        print("\n| monitor's background CPU, 8 GPUs, publish + record | idle | window per step |")
        print("|---|---:|---:|")
        for who in ("parent_threads", "sampler_process"):
            print(
                f"| {who.replace('_', ' ')} | {bg[f'{who}:idle'] * 100:.2f} % "
                f"| {bg[f'{who}:window per 40 ms step'] * 100:.2f} % |"
            )
        if "io_wakeups_per_s:idle" in bg:
            print(
                f"| parent I/O thread wake-ups per second | {bg['io_wakeups_per_s:idle']:.1f} "
                f"| {bg['io_wakeups_per_s:window per 40 ms step']:.1f} |"
            )
        source = "scheduler run time" if bg["precise_cpu"] else "user + system ticks"
        steps = bg["steps_per_s:window per 40 ms step"]
        print(f"\n(% of one core, from {source}; {steps:.1f} steps per second)")
        print(
            f"begin+end on the caller's thread, a 40 ms sleep apart (cold caches): median "
            f"{bg['edges_us_after_step']:.1f} µs"
        )
    if "contention" in parts:
        ct = results["contention"]
        lo, hi = ct["slowdown_ci"]
        print("\n| training step beside a process burning CPU (no monitor) | slowdown | 95 % CI |")
        print("|---|---:|---:|")
        print(
            f"| {ct['share'] * 100:.0f} % of a core in 10 ms cycles, {ct['rounds']} rounds "
            f"| {ct['slowdown'] * 100:.2f} % | {lo * 100:+.2f} .. {hi * 100:+.2f} % |"
        )
    if "gil" in parts:
        print("\n| background thread holding the GIL (no monitor) | training-step slowdown |")
        print("|---|---:|")
        for name, value in results["gil"].items():
            print(f"| {name} | {value * 100:.2f} % |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
