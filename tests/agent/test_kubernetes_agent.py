"""Pods through a real node agent: a kubelet PodResources endpoint (a real gRPC server on a
unix socket, ``kubelet_stub.py``) lists pods holding simulated GPUs, by UUID and by index; pods
come and go, the kubelet goes away and comes back; `zeus-async jobs` (live and from the
recording), Prometheus and the simulator's ground truth say who drew what. Real processes."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from zeus_async.agent.ledger import LEDGER_FILE
from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import RandomWorkload
from zeus_async.events import WorkloadChange, WorkloadEnergy
from zeus_async.store.reader import RecordingReader
from zeus_async.testing.procs import run_cli, sim_env, start_node_agent_ready

pytest.importorskip("grpc", reason="the kubelet stub needs grpcio: pip install 'zeus_async[k8s]'")
from kubelet_stub import Kubelet, container_msg, devices_msg, gpu_pod, pod_msg

logger = logging.getLogger(__name__)

# No simulated processes: every GPU is a pod's or nobody's.
CONFIG = SimConfig(
    num_gpus=4,
    seed=11,
    processes_per_gpu=0,
    workload=RandomWorkload(seg_min_s=0.2, seg_max_s=1.5),
)
NODE = SimNode(CONFIG, shared_state=False)
UUIDS = [g.uuid for g in NODE.gpus]  # what the agent's NVML reports, and the kubelet lists
S = 1_000_000_000

# Pods a and b (by UUID), idx (by index), d (a time-slicing replica of a UUID).
A, B, IDX, D = "k8s:ml/a/main", "k8s:ml/b/main", "k8s:batch/idx/w", "k8s:ml/d/main"


_cli = run_cli


def _jobs(env: dict[str, str], *args: str) -> dict[str, dict[str, Any]]:
    out = _cli(env, "jobs", "--json", *args)
    assert out.returncode == 0, out.stderr
    return {r["key"]: r for r in map(json.loads, out.stdout.splitlines())}


def _wait(what: str, done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # A short path: a unix socket's path must fit in 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="zk8s-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _wait_ticks(ledger: Path, n: int) -> None:
    """Wait for the agent's next ``n`` ticks: each ends renaming a new ledger file over the old
    one (a new inode)."""
    inodes = [ledger.stat().st_ino]

    def moved() -> bool:
        ino = ledger.stat().st_ino
        if ino != inodes[-1]:
            inodes.append(ino)
        return len(inodes) > n

    _wait(f"{n} ticks of the agent", moved)


def test_pods_through_a_node_agent(sockdir: Path, private_dir: Path, tmp_path: Path) -> None:
    env = sim_env(CONFIG)
    sock = sockdir / "kubelet.sock"
    rec = tmp_path / "node.zarc"
    idx = gpu_pod("idx", "batch", "w", ["2"])  # deviceIDStrategy: index
    times: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        kubelet = Kubelet(sock, pods=[gpu_pod("a", "ml", "main", [UUIDS[0]]), idx])
        stack.callback(lambda: kubelet.stop())  # the one serving then
        stderr = stack.enter_context((tmp_path / "agent.err").open("w+"))
        agent, ready = start_node_agent_ready(
            env,
            "--k8s-socket",
            str(sock),
            "--prometheus-port",
            "0",
            "--record",
            str(rec),
            stderr=stderr,
        )
        stack.callback(agent.communicate, timeout=30)
        stack.callback(agent.send_signal, signal.SIGINT)
        port = int(ready.rsplit("port ", 1)[1].rstrip(")\n"))

        kubelet.wait_calls(2)  # the first List's pods are applied and published
        live1 = _jobs(env)

        times["switch"], n = kubelet.serve([gpu_pod("b", "ml", "main", [UUIDS[1]]), idx])
        kubelet.wait_calls(n + 2)
        live2 = _jobs(env)

        # The kubelet goes away (its socket file too) for at least two of the agent's ticks.
        times["gone"] = time.time_ns()
        kubelet.stop()
        _wait_ticks(private_dir / LEDGER_FILE, 3)  # the first may have read it before it went
        live_away = _jobs(env)

        shared = devices_msg("nvidia.com/gpu.shared", [f"{UUIDS[3]}::1"])  # time-slicing
        back = [
            gpu_pod("b", "ml", "main", [UUIDS[1]]),
            idx,
            pod_msg("d", "ml", [container_msg("main", [shared])]),
        ]
        times["back"] = time.time_ns()
        kubelet = Kubelet(sock, pods=back)
        kubelet.wait_calls(2)
        live3 = _jobs(env)
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    with (tmp_path / "agent.err").open() as f:
        log = f.read()

    # -- live: `zeus-async jobs --json` ---------------------------------------------------------
    def view(rows: dict[str, dict[str, Any]]) -> dict[str, tuple[list[str], bool]]:
        return {k: (sorted(r["gpus"]), r["end_ns"] is None) for k, r in rows.items()}

    assert view(live1) == {A: (["0"], True), IDX: (["2"], True)}
    assert view(live2) == {A: (["0"], False), B: (["1"], True), IDX: (["2"], True)}
    assert view(live_away) == view(live2)  # what was known stays while the kubelet is away
    assert view(live3) == {
        A: (["0"], False),
        B: (["1"], True),
        IDX: (["2"], True),
        D: (["3"], True),
    }

    # -- the kubelet's absence: said once, and once that it is back -------------------------
    # (The agent's own log lines; gRPC's C core may add a line of its own, see the report.)
    said = [ln for ln in log.splitlines() if " zeus_async." in ln and "kubelet" in ln]
    assert len(said) == 2, log
    assert said[0] == (
        f"WARNING zeus_async.agent.workloads: kubelet pod-resources socket {sock} not found: not "
        "a Kubernetes node, or the kubelet keeps it elsewhere (give its path)"
    )
    assert said[1] == "WARNING zeus_async.agent.workloads: kubelet pod-resources answers again"

    # -- the recording ------------------------------------------------------------------------
    changes: dict[tuple[str, str], WorkloadChange] = {}
    energy: dict[str, WorkloadEnergy] = {}
    ticks_at: set[int] = set()
    for e in RecordingReader(rec):
        if type(e) is WorkloadChange:
            assert (e.key, e.state) not in changes, e
            changes[e.key, e.state] = e
        elif type(e) is WorkloadEnergy:
            energy[e.key] = e
            ticks_at.add(e.t_ns)
    assert {k: (c.gpus, c.namespace, c.pod, c.container) for k, c in changes.items()} == {
        (A, "started"): ([0], "ml", "a", "main"),
        (A, "ended"): ([], "ml", "a", "main"),
        (B, "started"): ([1], "ml", "b", "main"),
        (IDX, "started"): ([2], "batch", "idx", "w"),
        (D, "started"): ([3], "ml", "d", "main"),
    }
    offline = _jobs(env, str(rec))
    assert set(offline) == {A, B, IDX, D}
    for key, e in energy.items():
        assert offline[key]["gpus"] == {str(g): j for g, j in e.gpu_energy_j.items()}
        assert offline[key]["start_ns"] == changes[key, "started"].t_ns
        ended = changes.get((key, "ended"))
        assert offline[key]["end_ns"] == (None if ended is None else ended.t_ns)
    # The agent ticked (read the kubelet, published) at least twice while it was away.
    assert len([t for t in ticks_at if times["gone"] < t < times["back"]]) >= 2, ticks_at

    # -- Prometheus ---------------------------------------------------------------------------
    series = {
        ln.split("{", 1)[1].rsplit("}", 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in metrics.splitlines()
        if ln.startswith("zeus_workload_gpu_energy_joules_total{")
    }
    for key, gpu, ns, pod, container in (
        (A, 0, "ml", "a", "main"),
        (B, 1, "ml", "b", "main"),
        (IDX, 2, "batch", "idx", "w"),
        (D, 3, "ml", "d", "main"),
    ):
        found = [
            v
            for labels, v in series.items()
            if f'workload="{key}"' in labels
            and f'gpu="{gpu}"' in labels
            and f'namespace="{ns}"' in labels
            and f'pod="{pod}"' in labels
            and f'container="{container}"' in labels
            and 'kind="kubernetes"' in labels
        ]
        # scraped before the end; D may not have drawn a counter step yet
        assert len(found) == 1 and 0 <= found[0] <= energy[key].gpu_energy_j[gpu], (key, series)
        assert found[0] > 0 or key == D, (key, series)
    assert len(series) == 4, series

    # -- energy against the simulator's ground truth ------------------------------------------
    # The ledger credits each step of a GPU's energy counter (one per `counter` ns) to the
    # GPU's holder, sharing the step by time where the holder changed inside it. So a pod's
    # figure covers its holding interval [c0, c1] to within one counter step at each end: at
    # least the steps wholly inside, at most those touching it. c0 and c1 are the first samples
    # (10 ms apart) the ledger saw after the agent applied a List: within a few samples of the
    # WorkloadChange t_ns (the newest sample seen when the change was published; 5-10 ms
    # measured). `slack` is one counter step and 4 samples. A pod still running is counted up
    # to its GPU's last counter update before the last tick: up to a counter step before it.
    last_tick = max(e.t_ns for e in energy.values())
    counter = round(CONFIG.counter_period_s * S)
    slack = counter + 4 * S // 100
    figures = []
    for key, gpu, end in (
        (A, 0, changes[A, "ended"].t_ns),
        (B, 1, None),
        (IDX, 2, None),
        (D, 3, None),
    ):
        t0 = changes[key, "started"].t_ns
        t1 = last_tick if end is None else end
        got = energy[key].gpu_energy_j[gpu]
        truth = NODE.truth_energy_j(gpu, t0, t1)
        low = NODE.truth_energy_j(gpu, t0 + slack, t1 - slack - (counter if end is None else 0))
        high = NODE.truth_energy_j(gpu, t0 - slack, t1 + slack)
        figures.append(
            f"{key} GPU {gpu} over {(t1 - t0) / S:.2f} s: {got:.1f} J, truth {truth:.1f} J "
            f"({(got - truth) / truth:+.2%}), bounds [{low:.1f}, {high:.1f}]"
        )
        assert low <= got <= high, figures[-1]
    # The attribution follows the kubelet a refresh late: the agent reads List every second.
    delays = {
        "A ended": changes[A, "ended"].t_ns - times["switch"],
        "B started": changes[B, "started"].t_ns - times["switch"],
        "D started": changes[D, "started"].t_ns - times["back"],
    }
    a_kubelet = NODE.truth_energy_j(0, changes[A, "started"].t_ns, times["switch"])
    b_kubelet = NODE.truth_energy_j(1, times["switch"], last_tick)
    figures.append(
        "after the kubelet's change: "
        + ", ".join(f"{k} +{d / 1e6:.0f} ms" for k, d in delays.items())
        + f"; A {energy[A].gpu_energy_j[0]:.1f} J vs {a_kubelet:.1f} J from its own start to "
        f"the switch, B {energy[B].gpu_energy_j[1]:.1f} J vs {b_kubelet:.1f} J from the switch"
    )
    logger.info("\n".join(figures))
    assert all(0 < d < 2 * S for d in delays.values()), figures[-1]
