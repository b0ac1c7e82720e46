"""Process series carry a ``workload`` label when their samples name one (a node agent's), and
exactly the label set they had before when they do not."""

from __future__ import annotations

from prometheus_client import generate_latest

from zeus_async.events import ProcessSample
from zeus_async.exporters import PrometheusExporter

H = "node1"
T0 = 1_763_000_000_000_000_000
S = 1_000_000_000


def series(exporter: PrometheusExporter, prefix: str = "zeus_process_") -> list[str]:
    """The sample lines of the process families, in rendering order."""
    text = exporter.render()
    assert text == generate_latest(exporter.registry)  # byte for byte prometheus_client's
    return [ln for ln in text.decode().splitlines() if ln.startswith(prefix)]


def host_side(t_ns: int, pid: int, workload: str = "") -> ProcessSample:
    return ProcessSample(H, t_ns, pid, cpu_frac=0.125, memory_rss_bytes=2_000_000_000,
                         cpu_energy_j=1234.5, workload=workload)  # fmt: skip


def on_gpu(t_ns: int, pid: int, gpu: int, workload: str = "") -> ProcessSample:
    return ProcessSample(H, t_ns, pid, gpu=gpu, attributed_power_w=156.25,
                         attributed_energy_j=4321.5, workload=workload)  # fmt: skip


def test_process_series_carry_the_workload_label() -> None:
    exporter = PrometheusExporter()
    exporter.add([host_side(T0, 4242, "slurm:4711"), on_gpu(T0, 4242, 1, "slurm:4711"),
                  host_side(T0, 7, "uid:1001")])  # fmt: skip
    assert series(exporter) == [
        'zeus_process_cpu_ratio{host="node1",pid="4242",workload="slurm:4711"} 0.125',
        'zeus_process_cpu_ratio{host="node1",pid="7",workload="uid:1001"} 0.125',
        'zeus_process_memory_bytes{host="node1",kind="rss",pid="4242",workload="slurm:4711"} 2e+09',
        'zeus_process_memory_bytes{host="node1",kind="rss",pid="7",workload="uid:1001"} 2e+09',
        'zeus_process_cpu_energy_joules_total{host="node1",pid="4242",workload="slurm:4711"} '
        "1234.5",
        'zeus_process_cpu_energy_joules_total{host="node1",pid="7",workload="uid:1001"} 1234.5',
        'zeus_process_gpu_power_watts{gpu="1",host="node1",pid="4242",workload="slurm:4711"} '
        "156.25",
        'zeus_process_gpu_energy_joules_total{gpu="1",host="node1",pid="4242",'
        'workload="slurm:4711"} 4321.5',
    ]


def test_samples_without_a_workload_keep_the_label_set_they_had() -> None:
    exporter = PrometheusExporter()
    exporter.add([host_side(T0, 7), on_gpu(T0, 7, 0)])
    assert series(exporter) == [
        'zeus_process_cpu_ratio{host="node1",pid="7"} 0.125',
        'zeus_process_memory_bytes{host="node1",kind="rss",pid="7"} 2e+09',
        'zeus_process_cpu_energy_joules_total{host="node1",pid="7"} 1234.5',
        'zeus_process_gpu_power_watts{gpu="0",host="node1",pid="7"} 156.25',
        'zeus_process_gpu_energy_joules_total{gpu="0",host="node1",pid="7"} 4321.5',
    ]


def test_a_pids_series_take_its_latest_known_workload() -> None:
    exporter = PrometheusExporter()
    # Read mid-exec: its user's; then its job's once its environment shows. An unknown
    # answer later ("") leaves the label as it was.
    exporter.add([host_side(T0, 7, "uid:1001"), on_gpu(T0, 7, 0)])
    exporter.add([host_side(T0 + S, 7, "slurm:4711"), on_gpu(T0 + S, 7, 0, "slurm:4711")])
    exporter.add([host_side(T0 + 2 * S, 7), on_gpu(T0 + 2 * S, 7, 0)])
    assert series(exporter, "zeus_process_cpu_ratio") + series(
        exporter, "zeus_process_gpu_power_watts"
    ) == [
        'zeus_process_cpu_ratio{host="node1",pid="7",workload="slurm:4711"} 0.125',
        'zeus_process_gpu_power_watts{gpu="0",host="node1",pid="7",workload="slurm:4711"} 156.25',
    ]
