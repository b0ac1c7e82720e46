"""On a real NVIDIA GPU: how fast settings change, that every way a job stops restores them, and
which power scopes NVML answers. One markdown report, in one run of about a minute.

Written for the sessions lent a GPU machine, beside ``bench_real_gpu.py``; ``--sim`` runs it on
the simulator installed beneath ``pynvml`` (how it is checked without a GPU).

1. **Power scopes**: instant and average power in NVML's GPU, MODULE and MEMORY scopes, and the
   legacy ``nvmlDeviceGetPowerUsage``: what this GPU answers (a Grace superchip answers MODULE;
   other boards are expected to refuse it), for the superchip scope choice.
2. **Set latency**: wall time of ``nvmlDeviceSetPowerManagementLimit`` (minimum ↔ in force) and
   of ``nvmlDeviceSetGpuLockedClocks`` / ``nvmlDeviceResetGpuLockedClocks``, and, under a load,
   how long after the call returns the SM clock reads the locked value (what the pipeline
   frequency plans assume: ``bench_pfo_clocks.py`` models 2, 10 and 30 ms).
3. **Restore**: ``zeus_async.testing.restore_job --backend nvml`` (a Monitor that caps the GPU
   to its minimum power limit and locks its SM clock at 990 MHz) in its own process group,
   stopped by Ctrl-C to the group, SIGTERM to the group, SIGKILL of the training process, and
   SIGKILL of everything followed by the next Monitor's start. After each: the power limit read
   back, whether the clock is still locked (the SM clock under load), and the time from the
   signal to both restored.

The GPU is under a matrix-product load (torch on CUDA) throughout sections 2 and 3 so that a
locked clock shows. Whatever happens, the power limit in force before and unlocked clocks are
put back at the end. It never resets the GPU or touches MIG.

Run: ``python3 bench/hardware/bench_real_restore.py --out $OUT/real_restore.md`` (wheels as for
``bench_real_gpu.py``, bench/README.md), or ``.venv/bin/python
bench/hardware/bench_real_restore.py --sim``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_gpu import Report, _pct

#: Busy until killed: bf16 matrix products back to back.
LOAD_SCRIPT = r"""
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(a)
torch.cuda.synchronize()
print("ready", flush=True)
while True:
    for _ in range(4):
        a @ b
    torch.cuda.synchronize()
"""

#: The SM clock the restore job locks (``zeus_async.testing.restore_job``).
JOB_CLOCK_MHZ = 990


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return (
        f"{_pct(values, 0.5) * 1e3:.2f} / {_pct(values, 0.9) * 1e3:.2f} / {max(values) * 1e3:.2f}"
    )


class Gpu:
    """The raw NVML handle of one GPU, read the way a driver tool would from outside the job."""

    def __init__(self, index: int) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        lo, hi = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(self.handle)
        self.limit_range_mw = (int(lo), int(hi))
        self.limit_before_mw = int(pynvml.nvmlDeviceGetPowerManagementLimit(self.handle))
        self.max_sm_mhz = int(pynvml.nvmlDeviceGetMaxClockInfo(self.handle, pynvml.NVML_CLOCK_SM))

    def limit_mw(self) -> int:
        return int(self.nv.nvmlDeviceGetPowerManagementLimit(self.handle))

    def sm_mhz(self) -> int:
        return int(self.nv.nvmlDeviceGetClockInfo(self.handle, self.nv.NVML_CLOCK_SM))

    def locked(self) -> bool:
        """The SM clock held at or under the job's lock (under load an unlocked clock boosts)."""
        return self.sm_mhz() <= JOB_CLOCK_MHZ + 30

    def restored(self) -> bool:
        return self.limit_mw() == self.limit_before_mw and not self.locked()

    def put_back(self) -> None:
        nv = self.nv
        try:
            nv.nvmlDeviceSetPowerManagementLimit(self.handle, self.limit_before_mw)
        finally:
            nv.nvmlDeviceResetGpuLockedClocks(self.handle)


# -- 1. power scopes ---------------------------------------------------------------------------


def power_scopes(report: Report, gpu: Gpu) -> None:
    nv = gpu.nv
    report.add("## Power scopes\n")
    rows: list[list[object]] = []
    scopes = [
        ("GPU", getattr(nv, "NVML_POWER_SCOPE_GPU", 0)),
        ("MODULE", getattr(nv, "NVML_POWER_SCOPE_MODULE", 1)),
        ("MEMORY", getattr(nv, "NVML_POWER_SCOPE_MEMORY", 2)),
    ]
    fields = [
        ("instant", nv.NVML_FI_DEV_POWER_INSTANT),
        ("average (1 s)", nv.NVML_FI_DEV_POWER_AVERAGE),
    ]
    for fname, fid in fields:
        for sname, scope in scopes:
            try:
                (value,) = nv.nvmlDeviceGetFieldValues(gpu.handle, [(fid, scope)])
            except nv.NVMLError as exc:
                rows.append([fname, sname, f"call failed: {exc}"])
                continue
            if value.nvmlReturn != 0:
                rows.append([fname, sname, f"refused: {nv.nvmlErrorString(value.nvmlReturn)}"])
            else:
                rows.append([fname, sname, f"{value.value.uiVal / 1000:.1f} W"])
    try:
        rows.append(
            [
                "nvmlDeviceGetPowerUsage",
                "—",
                f"{nv.nvmlDeviceGetPowerUsage(gpu.handle) / 1000:.1f} W",
            ]
        )
    except nv.NVMLError as exc:
        rows.append(["nvmlDeviceGetPowerUsage", "—", f"refused: {exc}"])
    report.table(["reading", "scope", "answer"], rows)


# -- 2. set latency ----------------------------------------------------------------------------


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def set_latency(report: Report, gpu: Gpu, rounds: int) -> None:
    nv = gpu.nv
    h = gpu.handle
    report.add(f"## Set latency ({rounds} rounds, under load; ms median / p90 / max)\n")
    lowest = gpu.limit_range_mw[0]
    to_min: list[float] = []
    to_back: list[float] = []
    for _ in range(rounds):
        to_min.append(_timed(lambda: nv.nvmlDeviceSetPowerManagementLimit(h, lowest)))
        to_back.append(_timed(lambda: nv.nvmlDeviceSetPowerManagementLimit(h, gpu.limit_before_mw)))
    clocks = sorted(
        int(c)
        for c in nv.nvmlDeviceGetSupportedGraphicsClocks(
            h, max(nv.nvmlDeviceGetSupportedMemoryClocks(h))
        )
    )
    targets = [c for c in clocks if c <= 0.75 * gpu.max_sm_mhz][-1:] + [
        c for c in clocks if c <= 0.5 * gpu.max_sm_mhz
    ][-1:]
    lock: list[float] = []
    reset: list[float] = []
    settle: list[float] = []
    unsettled = 0
    for i in range(rounds):
        mhz = targets[i % len(targets)]
        lock.append(_timed(lambda m=mhz: nv.nvmlDeviceSetGpuLockedClocks(h, m, m)))  # type: ignore[misc]
        t0 = time.perf_counter()
        while gpu.sm_mhz() > mhz + 15:
            if time.perf_counter() - t0 > 0.5:
                unsettled += 1
                break
            time.sleep(0.0005)
        else:
            settle.append(time.perf_counter() - t0)
        reset.append(_timed(lambda: nv.nvmlDeviceResetGpuLockedClocks(h)))
        time.sleep(0.05)
    report.table(
        ["call", "ms median / p90 / max"],
        [
            [f"set power limit to the minimum ({lowest / 1000:g} W)", _ms(to_min)],
            [f"set power limit back ({gpu.limit_before_mw / 1000:g} W)", _ms(to_back)],
            [f"lock SM clocks ({', '.join(str(t) for t in targets)} MHz)", _ms(lock)],
            ["SM clock reads the locked value, after the lock call returned", _ms(settle)],
            ["reset locked SM clocks", _ms(reset)],
        ],
    )
    if unsettled:
        report.add(f"{unsettled} of {rounds} locks did not read back within 0.5 s.\n")


# -- 3. restore --------------------------------------------------------------------------------


def _start_job(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    argv = [sys.executable, "-m", "zeus_async.testing.restore_job", "--backend", "nvml"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("capped"):
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"the restore job did not start: {line!r} {err}")
    return proc, int(line.split()[1])


def _wait(pred: Callable[[], bool], timeout_s: float) -> float | None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if pred():
            return time.perf_counter() - t0
        time.sleep(0.005)
    return None


def _capped(gpu: Gpu) -> str:
    """The settings while the job runs, once the lock shows (a real GPU's clock takes tens of
    ms after the call to settle, see the set latency)."""
    took = _wait(gpu.locked, 2.0)
    seen = f"{gpu.limit_mw() / 1000:g} W, {gpu.sm_mhz()} MHz"
    return seen if took is not None else f"{seen} (the lock never showed)"


def restore(report: Report, gpu: Gpu, env: dict[str, str]) -> bool:
    report.add("## Restore on every way a job stops\n")
    rows: list[list[object]] = []
    ok = True
    ways: list[tuple[str, Callable[[subprocess.Popen[str], int], None]]] = [
        ("Ctrl-C to the process group", lambda p, a: os.killpg(p.pid, signal.SIGINT)),
        ("SIGTERM to the process group", lambda p, a: os.killpg(p.pid, signal.SIGTERM)),
        ("SIGKILL of the training process", lambda p, a: p.kill()),
    ]
    for name, stop in ways:
        proc, agent = _start_job(env)
        capped = _capped(gpu)
        t0 = time.perf_counter()
        stop(proc, agent)
        took = _wait(gpu.restored, 20.0)
        proc.wait(timeout=20)
        proc.communicate()
        ok &= took is not None
        rows.append(
            [
                name,
                capped,
                f"{gpu.limit_mw() / 1000:g} W, {gpu.sm_mhz()} MHz",
                "NOT restored" if took is None else f"{(time.perf_counter() - t0) * 1e3:.0f}",
            ]
        )
        if took is None:
            gpu.put_back()
    # SIGKILL of the job and its sampler: nobody is left; the next Monitor restores.
    proc, agent = _start_job(env)
    capped = _capped(gpu)
    os.kill(agent, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=20)
    proc.communicate()
    time.sleep(0.5)
    left = gpu.restored()
    code = "from zeus_async import Monitor; Monitor(backend='nvml', cpu_indices=[]).close()"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    took = _wait(gpu.restored, 5.0)
    ok &= took is not None and not left
    rows.append(
        [
            "SIGKILL of everything, then a new Monitor"
            + (" (restored before it: unexpected)" if left else ""),
            capped,
            f"{gpu.limit_mw() / 1000:g} W, {gpu.sm_mhz()} MHz",
            "NOT restored"
            if took is None
            else f"{(time.perf_counter() - t0) * 1e3:.0f} (the new Monitor's start)",
        ]
    )
    report.table(
        ["how the job stopped", "while running (limit, SM clock)", "after", "ms to restored"],
        rows,
    )
    report.add(
        f"In force before: {gpu.limit_before_mw / 1000:g} W, clocks unlocked "
        f"(max SM {gpu.max_sm_mhz} MHz). Restored means that limit read back and the SM clock "
        f"under load above {JOB_CLOCK_MHZ + 30} MHz.\n"
    )
    return ok


# -- main --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    report = Report()
    report.add(f"# zeus_async settings on {'the simulator' if args.sim else 'a real GPU'}\n")
    report.add(f"`{' '.join(sys.argv)}`, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
    gpu = Gpu(args.gpu)
    env = dict(os.environ)
    env.setdefault("CUDA_VISIBLE_DEVICES", str(args.gpu))
    load: subprocess.Popen[str] | None = None
    ok = False
    try:
        power_scopes(report, gpu)
        if not args.sim:
            load = subprocess.Popen(
                [sys.executable, "-c", LOAD_SCRIPT], stdout=subprocess.PIPE, text=True
            )
            assert load.stdout is not None
            if load.stdout.readline().strip() != "ready":
                raise SystemExit("the load did not start (is torch with CUDA installed?)")
            time.sleep(1.0)
        set_latency(report, gpu, args.rounds)
        ok = restore(report, gpu, env)
    finally:
        try:
            gpu.put_back()
        finally:
            if load is not None:
                load.kill()
                load.wait(timeout=30)
        report.add(
            f"Afterwards: {gpu.limit_mw() / 1000:g} W in force (before: "
            f"{gpu.limit_before_mw / 1000:g} W)\n"
        )
        if args.out is not None:
            args.out.write_text("\n".join(report.lines) + "\n")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim", action="store_true", help="run on the simulator (no GPU needed)")
    parser.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per set-latency figure")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sim and not args.child:
        from zeus_async.devices.sim import SimConfig
        from zeus_async.devices.sim_workload import ConstantWorkload
        from zeus_async.testing.sim_pynvml import shim_env

        config = SimConfig(
            num_gpus=1,
            seed=1,
            workload=ConstantWorkload(1.0),
            set_clock_latency_s=0.002,
        )
        env = {**os.environ, **shim_env(config)}
        raise SystemExit(subprocess.call([sys.executable, *sys.argv, "--child"], env=env))
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
