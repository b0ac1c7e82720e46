"""Energy per job across nodes, through a real Prometheus server: three node agents (distinct
host ids, one machine) scraped every 0.5 s, a job on all three and one on a single node;
`sum by (job_id) (increase(zeus_workload_gpu_energy_joules_total[...]))` equals what the
nodes' epilogs and recordings say within 0.5 %, across one agent killed, left down 30 s (a
scrape gap) and started again. Real processes, a real Prometheus (Debian's package)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from zeus_async.devices.sim import SimConfig, SimNode
from zeus_async.devices.sim_workload import RandomWorkload
from zeus_async.testing.procs import run_cli, sim_env, start_node_agent_ready

CONFIG = SimConfig(num_gpus=2, seed=9, workload=RandomWorkload(seg_min_s=0.2, seg_max_s=1.5))
GAP_S = 30.0
SCRAPES = 4  # samples of each job's series on each side of the gap (2 s at 0.5 s)


def _prometheus() -> str:
    path = shutil.which("prometheus")
    if path is None:
        reason = "the Prometheus server is not installed (apt-get install prometheus)"
        if os.environ.get("ZEUS_ASYNC_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(reason + " and ZEUS_ASYNC_REQUIRE_PROMETHEUS=1 is set")
        pytest.skip(reason)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_cli = run_cli


class Node:
    """One node: its own private directory (its agent, its ledger), host id and port."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.name = name
        d = tmp / name
        d.mkdir(mode=0o700)
        self.env = sim_env(CONFIG, ZEUS_ASYNC_DIR=str(d))
        self.port = _free_port()
        self.recordings: list[Path] = []
        self.agent: subprocess.Popen[str] | None = None
        self.tmp = tmp

    def start(self) -> None:
        rec = self.tmp / f"{self.name}-{len(self.recordings)}.zarc"
        self.recordings.append(rec)
        self.agent, _ = start_node_agent_ready(
            self.env,
            "--host-id",
            self.name,
            "--prometheus-port",
            str(self.port),
            "--record",
            str(rec),
        )

    def kill(self) -> None:
        assert self.agent is not None
        self.agent.kill()
        self.agent.communicate(timeout=30)

    def stop(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGINT)
            self.agent.communicate(timeout=30)

    def job(self, *args: str) -> dict[str, Any]:
        out = _cli(self.env, "job", *args)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout) if "--json" in args else {}

    def recorded(self) -> dict[str, float]:
        """Each job's energy as this node's last recording has it (the ledger's counters)."""
        out = _cli(self.env, "jobs", str(self.recordings[-1]), "--json")
        assert out.returncode == 0, out.stderr
        return {r["key"]: r["energy_j"] for r in map(json.loads, out.stdout.splitlines())}


@pytest.mark.slow
def test_prometheus_sums_jobs_across_nodes_an_agent_restart_and_a_scrape_gap(
    tmp_path: Path,
) -> None:
    binary = _prometheus()
    nodes = [Node(tmp_path, f"node{i}") for i in range(3)]
    web = _free_port()
    config = tmp_path / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{n.port}'" for n in nodes)
    config.write_text(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 500ms\n"
        "scrape_configs:\n  - job_name: zeus\n    static_configs:\n"
        f"      - targets: [{targets}]\n"
    )
    log = tmp_path / "prometheus.log"
    base = f"http://127.0.0.1:{web}"
    with log.open("wb") as out:
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{web}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def query(q: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": q} | ({} if at is None else {"time": f"{at:.3f}"})
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            data = json.loads(r.read())
        assert data["status"] == "success", data
        return list(data["data"]["result"])

    try:
        for n in nodes:
            n.start()
        deadline = time.monotonic() + 30
        while len(query("up == 1")) < 3:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

        jobs = {(n.name, "41") for n in nodes} | {("node2", "42")}

        def scraped(since: float) -> None:
            """Until Prometheus holds ``SCRAPES`` samples, taken after ``since`` (wall clock,
            s), of each job's series on each node (polled, not a fixed wait: on a loaded
            machine scrapes can come late)."""
            deadline = time.monotonic() + 60
            while True:
                window = max(1, int(time.time() - since))
                counts = {
                    (r["metric"]["host"], r["metric"]["job_id"]): float(r["value"][1])
                    for r in query(
                        f"count_over_time(zeus_workload_gpu_energy_joules_total[{window}s])"
                        " and zeus_workload_gpu_energy_joules_total > 0"
                    )
                }
                if all(counts.get(key, 0.0) >= SCRAPES for key in jobs):
                    return
                assert time.monotonic() < deadline, (counts, log.read_text()[-3000:])
                time.sleep(0.2)

        started = time.time()
        for n in nodes:
            n.job("start", "--job", "41", "--gpus", "0", "--user", "root")
        nodes[2].job("start", "--job", "42", "--gpus", "1", "--user", "root")
        scraped(started)  # every job's series, on every node, before the gap
        nodes[1].kill()  # no goodbye: its ledger on disk is what is left
        time.sleep(GAP_S)  # no scrape of node1 for 30 s; its job goes on
        restarted = time.time()
        nodes[1].start()
        scraped(restarted)  # node1's series again, after the gap, and the others
        ended = {(n.name, "41"): n.job("end", "--job", "41", "--json") for n in nodes}
        ended[("node2", "42")] = nodes[2].job("end", "--job", "42", "--json")
        # Scraped until Prometheus holds each node's final figure (on a loaded machine a
        # scrape can miss its 0.5 s deadline), then twice more, flat after the end.
        deadline = time.monotonic() + 60
        while True:
            seen = {
                (r["metric"]["host"], r["metric"]["job_id"]): float(r["value"][1])
                for r in query("zeus_workload_gpu_energy_joules_total")
            }
            if all(
                seen.get(key) == pytest.approx(report["energy_j"], rel=1e-9)
                for key, report in ended.items()
            ):
                # Each node's last sample so far (later ones repeat the final figures): once
                # the agents stop, their series go stale and an instant query finds none.
                last_at = {
                    r["metric"]["host"]: float(r["value"][1])
                    for r in query(
                        "max by (host) (timestamp(zeus_workload_gpu_energy_joules_total))"
                    )
                }
                break
            assert time.monotonic() < deadline, (seen, ended)
            time.sleep(0.25)
        time.sleep(1.0)
    finally:
        for n in nodes:
            n.stop()
    try:
        # Each node's sum at its own last scrape: increase() extrapolates to the end of its
        # range at the series' average rate whenever the range ends after the last sample
        # (here by up to a scrape interval, +0.5 % of the job's energy: targets are scraped at
        # different instants). Per node, at its last sample, it has nothing to extrapolate.
        summed: dict[str, float] = {}
        for n in nodes:
            metric = f'zeus_workload_gpu_energy_joules_total{{host="{n.name}"}}'
            for r in query(f"sum by (job_id) (increase({metric}[5m]))", at=last_at[n.name]):
                job_id = r["metric"]["job_id"]
                summed[job_id] = summed.get(job_id, 0.0) + float(r["value"][1])
    finally:
        prom.terminate()
        prom.wait(timeout=30)
    epilogs = {"41": 0.0, "42": 0.0}
    for (_, job), report in ended.items():
        epilogs[job] += report["energy_j"]
    recorded = {"41": 0.0, "42": 0.0}
    for n in nodes:
        for key, joules in n.recorded().items():
            recorded[key.removeprefix("slurm:")] += joules
    node = SimNode(CONFIG, shared_state=False)
    truth = {
        "41": sum(
            node.truth_energy_j(0, r["start_ns"], r["end_ns"])
            for (_, job), r in ended.items()
            if job == "41"
        ),
        "42": node.truth_energy_j(
            1, ended[("node2", "42")]["start_ns"], ended[("node2", "42")]["end_ns"]
        ),
    }
    print(
        json.dumps({"prometheus": summed, "recorded": recorded, "epilogs": epilogs, "truth": truth})
    )
    for job in ("41", "42"):
        assert summed[job] == pytest.approx(recorded[job], rel=0.005), (job, summed, recorded)
        assert summed[job] == pytest.approx(epilogs[job], rel=0.005), (job, summed, epilogs)
        assert epilogs[job] == pytest.approx(truth[job], rel=0.005), (job, epilogs, truth)
