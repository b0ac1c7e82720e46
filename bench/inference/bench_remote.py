"""Requests through the node agent: a RemoteMeter's throughput, lag and cost.

Starts a node agent on the simulator (one GPU) in a private directory of its own, then one
serving process (this one) sends ``--requests`` requests (begin, decode, end: 3 edges each)
through a :class:`~zeus_async.inference.remote.RemoteMeter` at ``--rate`` per second
(``inf``: as fast as the loop goes), and waits for every result to come back. Prints how long
sending took, how long after the last request the last result came, what was dropped, and
the agent's conservation (|measured - requests - idle| / measured, GPU 0). Then the serving
thread's cost per edge, RequestMeter beside RemoteMeter (no agent: the edges are dropped).

Run: ``.venv/bin/python bench/inference/bench_remote.py [--requests 20000] [--rate 2000]``
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rate", type=float, default=2000.0)
    args = p.parse_args()
    os.environ["ZEUS_ASYNC_DIR"] = tempfile.mkdtemp(prefix="za-")

    import msgspec

    from zeus_async.agent.client import agent_request, node_agent_config
    from zeus_async.agent.protocol import Control
    from zeus_async.agent.server import NODE_SOCKET, node_agent_running
    from zeus_async.devices.sim_config import SimConfig
    from zeus_async.inference.meter import RequestMeter
    from zeus_async.inference.remote import RemoteMeter
    from zeus_async.testing.procs import sim_env

    cfg = node_agent_config(
        backend="sim", requests_settle_s=0.1, requests_edge_delay_s=0.3, workloads=False
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "zeus_async.agent.server", msgspec.json.encode(cfg)],
        env=sim_env(SimConfig(num_gpus=1, seed=1)),
    )
    sock = os.path.join(os.environ["ZEUS_ASYNC_DIR"], NODE_SOCKET)
    while not (node_agent_running() and os.path.exists(sock)):
        time.sleep(0.05)
    try:
        n, rate = args.requests, args.rate
        meter = RemoteMeter(batch_s=0.05)
        meter.wait_connected()
        t0 = time.monotonic()
        for i in range(n):
            rid = f"r{i}"
            meter.begin(rid)
            meter.phase(rid)
            meter.end(rid, tokens_in=10, tokens_out=5)
            if math.isfinite(rate):
                ahead = t0 + (i + 1) / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
        send_s = time.monotonic() - t0
        while len(meter.results()) < n and time.monotonic() - t0 < send_s + 60:
            time.sleep(0.02)
        lag_s = time.monotonic() - t0 - send_s
        totals = agent_request(cfg.endpoint, Control(seq=1, op="requests")).requests_totals
        assert totals is not None
        e = totals.energy_j[0]
        off = abs(e - totals.requests_j[0] - totals.idle_j[0]) / e
        print(
            f"{n} requests at {rate:g}/s: sent in {send_s:.2f} s; {len(meter.results())} "
            f"results, the last {lag_s:.2f} s after the last request; dropped "
            f"{meter.totals.dropped or 0}; {meter.totals.sent_batches} batches; the agent "
            f"settled {totals.requests}, bad input {totals.bad_input or 0}; "
            f"|E - R - I| / E = {off:.1e}"
        )
        meter.close()
    finally:
        agent.terminate()
        agent.wait()

    k = 200_000
    local = RequestMeter()
    remote = RemoteMeter(f"ipc://{os.environ['ZEUS_ASYNC_DIR']}/none.sock", max_queue=10**7)
    for name, m in (("RequestMeter", local), ("RemoteMeter", remote)):
        ids = [f"r{i}" for i in range(k)]
        t = time.perf_counter()
        for rid in ids:
            m.begin(rid, (0,))
            m.phase(rid)
            m.end(rid, tokens_in=10, tokens_out=5)
        print(f"serving thread, {name}: {(time.perf_counter() - t) / (3 * k) * 1e6:.2f} us/edge")
    remote.close()


if __name__ == "__main__":
    main()
