"""A client of a system agent, driven line by line, for ``test_system_agent.py``.

The test starts this as another user (``python system_client.py``, with
``ZEUS_ASYNC_SYSTEM_AGENT`` naming the agent's socket) and writes one JSON command per line on
its stdin; each is answered by one JSON line on stdout: ``{"ok": true, ...}`` or
``{"ok": false, "type": "LeaseConflictError", "message": "..."}``. The process keeps its
Monitors (and so its leases) between commands, as a training job would.

Commands (``op``):

* ``open`` (``gpus``: the Monitor's GPUs, default all; ``slot``: a name for it): a Monitor
  found by the default discovery; answers its GPUs and their power-limit ranges.
* ``power`` (``watts``, ``gpus``, ``slot``), ``clocks`` (``mhz`` or null, ``gpus``, ``slot``),
  ``release`` (``gpus``, ``setting``, ``slot``): through that Monitor, waited for.
* ``window`` (``slot``): measure one short window; answers its energy.
* ``optimize`` (``slot``): run the power-limit optimizer on that Monitor to its choice;
  answers the limits it profiled and the one chosen.
* ``close`` (``slot``).
* ``raw_open`` (``id``: a routing id, hex), ``raw_power`` (``watts``, ``gpus``),
  ``raw_send`` (``bye`` and/or ``release``): a bare connection that names itself, to check
  that a connection with another's routing id cannot act as it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from zeus_async import Monitor
from zeus_async.agent.protocol import Bye, Control, Hello, Reply

monitors: dict[str, Monitor] = {}
raw: dict[str, Any] = {}
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Reply)


def _raw_wait(sock: Any, timeout_ms: int) -> Reply | None:
    if sock.poll(timeout_ms):
        return _dec.decode(sock.recv())
    return None


def handle(cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["op"]
    slot = cmd.get("slot", "main")
    if op == "open":
        m = Monitor(gpu_indices=cmd.get("gpus"))
        monitors[slot] = m
        return {
            "gpus": m.gpu_indices,
            "ranges": [[d.power_limit_min_w, d.power_limit_max_w] for d in m.gpu_devices],
            "pid": os.getpid(),
        }
    if op == "power":
        monitors[slot].set_power_limit(cmd["watts"], cmd["gpus"], source="test").result(30)
        return {}
    if op == "clocks":
        monitors[slot].set_sm_clocks(cmd["mhz"], cmd["gpus"], source="test").result(30)
        return {}
    if op == "release":
        monitors[slot].release(cmd.get("gpus"), cmd.get("setting")).result(30)
        return {}
    if op == "window":
        with monitors[slot].window("w") as w:
            time.sleep(0.05)
        assert w.result is not None
        return {"energy_j": w.result.total_energy}
    if op == "optimize":
        from zeus_async.optimizer import GlobalPowerLimitOptimizer

        opt = GlobalPowerLimitOptimizer(
            monitors[slot], wait_steps=0, warmup_steps=0, profile_steps=2, pl_step=125
        )
        deadline = time.monotonic() + 60
        while opt.optimal_power_limit is None and time.monotonic() < deadline:
            opt.on_step_begin()
            time.sleep(0.02)
        return {"limits": opt.power_limits, "optimal": opt.optimal_power_limit}
    if op == "close":
        monitors.pop(slot).close()
        return {}
    if op == "raw_open":
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, bytes.fromhex(cmd["id"]))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{os.environ['ZEUS_ASYNC_SYSTEM_AGENT']}")
        sock.send(_enc.encode(Hello(os.getpid(), cmd.get("name", "raw"))))
        raw["sock"], raw["seq"] = sock, 0
        reply = _raw_wait(sock, cmd.get("wait_ms", 10_000))
        return {"reply": None if reply is None else reply.kind}
    if op == "raw_power":
        raw["seq"] += 1
        sock = raw["sock"]
        sock.send(
            _enc.encode(
                Control(raw["seq"], "set_power_limit", watts=cmd["watts"], gpus=cmd["gpus"])
            )
        )
        reply = _raw_wait(sock, 10_000)
        if reply is None:
            return {"reply": None}
        return {"reply": reply.kind, "error": reply.error_type, "message": reply.message}
    if op == "raw_send":
        sock = raw["sock"]
        if cmd.get("release"):
            raw["seq"] += 1
            sock.send(_enc.encode(Control(raw["seq"], "release")))
        if cmd.get("bye"):
            sock.send(_enc.encode(Bye()))
        reply = _raw_wait(sock, 1000)
        return {"reply": None if reply is None else reply.kind}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            out = {"ok": True, **handle(cmd)}
        except Exception as exc:
            out = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            if not isinstance(exc, (PermissionError, ValueError, RuntimeError)):
                out["trace"] = traceback.format_exc()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
