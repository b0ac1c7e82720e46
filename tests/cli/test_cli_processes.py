"""CLI: tracking a command's processes, and the Prometheus exporter (real processes)."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest
from cli_helpers import free_port, popen, run_cli
from prometheus_client.parser import text_string_to_metric_families

from zeus_async.events import GpuSample, ProcessSample
from zeus_async.store import RecordingReader

BURN = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\nraise SystemExit(3)"


def scrape(port: int, timeout: float = 20.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
            break
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.mark.slow
def test_monitor_runs_a_command_tracks_it_and_returns_its_exit_code(tmp_path: object) -> None:
    path = f"{tmp_path}/run.zarc"
    proc = run_cli(
        "monitor", "--backend", "sim", "--cpus", "none", "--refresh", "0.3",
        "--process-period", "0.25", "--record", path, "--", sys.executable, "-c", BURN,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr  # the command's exit code
    assert "running" in proc.stdout and "process" in proc.stdout
    samples = [e for e in RecordingReader(path) if isinstance(e, ProcessSample)]
    busy = [s.cpu_frac for s in samples if s.gpu is None and s.cpu_frac is not None]
    assert busy and max(busy) > 0.2  # the command burns CPU (of 2 cores here: up to 0.5)


def test_process_table_shows_cpu_as_top_does_percent_of_one_core(tmp_path: object) -> None:
    """Issue 34: "CPU %" was the share of the whole machine (a process keeping one of 64 cores
    busy read 1.6), under a label read as top's per-core %CPU."""
    path = f"{tmp_path}/run.zarc"
    proc = run_cli(
        "monitor", "--backend", "sim", "--cpus", "none", "--quiet", "--process-period", "0.25",
        "--record", path, "--", sys.executable, "-c", BURN,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    table = proc.stdout.split("Totals")[1].split("\n\n", 1)[1].splitlines()
    assert table[0].split()[:4] == ["process", "%CPU", "(core)", "PSS"]
    # Each process named as top names it: pid and command.
    rows = {line.split()[1]: line.split()[3] for line in table[2:] if line.startswith("pid ")}
    names = {line.split()[1]: line.split()[2] for line in table[2:] if line.startswith("pid ")}
    samples = [e for e in RecordingReader(path) if isinstance(e, ProcessSample)]
    host_side = [s for s in samples if s.gpu is None and s.cpu_frac is not None]
    cores = os.cpu_count() or 1
    burner = max(host_side, key=lambda s: s.cpu_frac or 0.0).pid
    # the table's figure is one of the samples' (the latest), per core: cpu_frac * cores * 100
    assert names[str(burner)].startswith("python"), names
    shown = float(rows[str(burner)])
    per_core = [s.cpu_frac * cores * 100 for s in host_side if s.pid == burner and s.cpu_frac]
    assert any(f"{shown:.1f}" == f"{v:.1f}" for v in per_core), (shown, per_core)
    # a busy single-threaded loop: never more than one core (plus the rounding of CPU time to
    # clock ticks; how much of it the loop gets depends on the machine's load)
    assert 0.0 < max(per_core) <= 110.0


def test_monitor_samples_before_the_command_starts(tmp_path: object) -> None:
    """The command's start-up is measured: the first samples come before its first
    instruction, and the GPUs' spans cover its whole run (1.74 s was reported for `sleep 2`)."""
    path = f"{tmp_path}/run.zarc"
    code = "import time; print('started', time.time_ns(), flush=True); time.sleep(1.5)"
    proc = run_cli(
        "monitor", "--backend", "sim", "--cpus", "none", "--quiet", "--record", path,
        "--", sys.executable, "-c", code,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    started = int(proc.stdout.split("started ")[1].split()[0])
    first = min(e.t_ns for e in RecordingReader(path) if isinstance(e, GpuSample))
    assert first < started
    totals = proc.stdout.split("Totals")[1]
    spans = [float(line.split()[2]) for line in totals.splitlines() if line.startswith("gpu:")]
    assert len(spans) == 4 and min(spans) >= 1.5


def test_a_command_that_cannot_run_is_one_line_and_never_sampled() -> None:
    proc = run_cli("monitor", "--backend", "sim", "--", "no-such-command-zeus")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "zeus-async monitor: cannot run 'no-such-command-zeus': command not found or not executable"
    )


def test_monitor_stops_when_the_command_exits_not_at_the_next_refresh() -> None:
    # With --refresh 30 it ran (and measured) until the next redraw, 30 s after the command.
    proc = run_cli(
        "monitor", "--backend", "sim", "--cpus", "none", "--refresh", "30",
        "--", sys.executable, "-c", "raise SystemExit(3)",
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    totals = proc.stdout.split("Totals")[1]
    spans = [float(line.split()[2]) for line in totals.splitlines() if line.startswith("gpu:")]
    assert spans and max(spans) < 10.0


@pytest.mark.slow
def test_exporter_serves_sampled_metrics_and_a_monitor_stream() -> None:
    port = free_port()
    exporter = popen("exporter", "--backend", "sim", "--cpus", "none", "--port", str(port),
                     "--period", "0.05", "--duration", "30", "--gpu-processes")  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            metrics = scrape(port)
            if "zeus_process_gpu_power_watts" in metrics or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        gpus = {labels["gpu"] for labels, _ in metrics["zeus_gpu_power_watts"]}
        assert gpus == {"0", "1", "2", "3"}
        assert all(v > 0 for _, v in metrics["zeus_gpu_energy_joules_total"])
        assert {lab["gpu"] for lab, _ in metrics["zeus_process_gpu_power_watts"]} == gpus
    finally:
        exporter.terminate()
        exporter.wait(timeout=20)

    # --connect: export the stream of a running monitor, under dcgm-exporter's names.
    pub, port = free_port(), free_port()
    monitor = popen("monitor", "--backend", "sim", "--cpus", "none", "--gpus", "0",
                    "--publish", f"tcp://127.0.0.1:{pub}", "--duration", "30")  # fmt: skip
    exporter = popen("exporter", "--connect", f"tcp://127.0.0.1:{pub}", "--port", str(port),
                     "--duration", "30", "--names", "dcgm")  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while "DCGM_FI_DEV_POWER_USAGE" not in (metrics := scrape(port)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        ((labels, watts),) = metrics["DCGM_FI_DEV_POWER_USAGE"]
        assert labels["gpu"] == "0" and labels["device"] == "nvidia0" and watts > 0
        # The stream's description (sent to each new subscriber) names the GPU.
        assert labels["UUID"].startswith("GPU-") and labels["modelName"].startswith("NVIDIA")
        assert "zeus_gpu_power_watts" not in metrics
    finally:
        for p in (exporter, monitor):
            p.terminate()
            p.wait(timeout=20)


def test_exporter_port_in_use_is_one_line() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("exporter", "--backend", "sim", "--cpus", "none", "--port", str(port),
                       "--duration", "1")  # fmt: skip
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0], proc.stderr


def test_bad_pid_is_a_usage_error() -> None:
    proc = run_cli("monitor", "--pid", "-4")
    assert proc.returncode == 2 and "process ids are positive" in proc.stderr


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_monitor_interrupted_with_its_command_running_exits_with_the_signal_status(
    signum: int, status: int
) -> None:
    # As a shell reports a command killed by the signal: a job script sees it did not finish.
    proc = popen(
        "monitor", "--backend", "sim", "--cpus", "none", "--refresh", "0.2",
        "--", sys.executable, "-c", "import time; time.sleep(60)",
    )  # fmt: skip
    assert proc.stdout is not None
    assert "running" in proc.stdout.readline()
    time.sleep(0.5)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == status, err
    assert "Totals" in out  # still a clean stop: the totals are printed
