"""Entry point of the sampler process started by :class:`~zeus_async.runtime.SamplerProcess`.

``python -m zeus_async.runtime._sampler_child CONFIG_JSON``: runs a :class:`Runtime` with
measurement windows, receives window edges (stamped by the parent) on a PULL socket and
returns each finished window's :class:`~zeus_async.events.Measurement` on a PUSH socket.
Not a public interface.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from .runtime import Runtime
from .sampler_process import ChildConfig, Control, Edge, Reply, Stop

logger = logging.getLogger(__name__)


async def _run(cfg: ChildConfig) -> None:
    from ..devices.sim import SimConfig
    from ..monitor import window_log_consumer

    actx = zmq.asyncio.Context()
    sctx = zmq.Context()
    edges = actx.socket(zmq.PULL)
    edges.connect(cfg.edges)
    replies = sctx.socket(zmq.PUSH)
    replies.connect(cfg.replies)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(Edge | Stop | Control)

    def send(reply: Reply) -> None:
        try:
            replies.send(enc.encode(reply), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("parent is not reading replies; dropped one")

    sim_config: Any = (
        msgspec.json.decode(cfg.sim_config, type=SimConfig) if cfg.sim_config else None
    )
    consumers = [window_log_consumer(cfg.log_file)] if cfg.log_file else []
    processes = cfg.processes
    if processes is not None:
        # The parent's process tree, less this sampler process.
        processes = msgspec.structs.replace(processes, exclude=(*processes.exclude, os.getpid()))
    try:
        async with Runtime(
            backend=cfg.backend,
            gpus=cfg.gpus,
            cpus=cfg.cpus if cfg.cpus is not None else "auto",
            period_s=cfg.period_s,
            fields=cfg.fields,
            adaptive_reads=cfg.adaptive_reads,
            publish=cfg.publish,
            sim_config=sim_config,
            windows=True,
            finalize_timeout_s=cfg.finalize_timeout_s,
            consumers=consumers,
            record=cfg.record,
            processes=processes,
            meta=cfg.meta,
            prometheus_port=cfg.prometheus_port,
            prometheus_addr=cfg.prometheus_addr,
        ) as rt:
            tracker = rt.tracker
            assert tracker is not None
            tracker.on_result = lambda m: send(Reply(kind="measurement", measurement=m))
            endpoint = rt.publisher.endpoint if rt.publisher is not None else None
            send(
                Reply(
                    kind="ready",
                    gpus=sorted(tracker.gpu_indices),
                    cpus=sorted(tracker.cpu_packages),
                    backend=rt.backend,
                    endpoint=endpoint,
                    devices=[d.describe() for d in rt.devices if d.key.startswith("gpu:")],
                    prometheus_port=rt.prometheus_port,
                )
            )

            async def control_worker(queue: MemoryObjectReceiveStream[Control]) -> None:
                async for msg in queue:  # one at a time, in the order the parent sent them
                    await control(msg)

            async def control(msg: Control) -> None:
                try:
                    if msg.op == "set_power_limit":
                        await rt.set_power_limit(msg.watts, msg.gpus, source=msg.source)
                    elif msg.op == "set_sm_clocks":
                        await rt.set_sm_clocks(msg.mhz, msg.gpus, source=msg.source)
                    elif msg.event is not None:
                        await rt.publish(msg.event)
                except Exception as exc:
                    send(
                        Reply(
                            kind="control",
                            seq=msg.seq,
                            error_type=type(exc).__name__,
                            message=str(exc),
                        )
                    )
                else:
                    send(Reply(kind="control", seq=msg.seq))

            controls_in, controls_out = anyio.create_memory_object_stream[Control](1000)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch_parent, cfg.parent_pid, tg.cancel_scope)
                tg.start_soon(control_worker, controls_out)
                while True:
                    msg = dec.decode(await edges.recv())
                    if isinstance(msg, Stop):
                        break
                    if isinstance(msg, Control):
                        await controls_in.send(msg)
                        continue
                    try:
                        if msg.open:
                            tracker.open(
                                msg.name, restart=msg.restart, t_ns=msg.t_ns, window_id=msg.id
                            )
                        else:
                            tracker.close(msg.name, cancel=msg.cancel, t_ns=msg.t_ns)
                    except ValueError as exc:  # the parent keeps the books; this is a bug
                        logger.error("bad window edge %r: %s", msg, exc)
                tg.cancel_scope.cancel()
    except Exception as exc:
        send(Reply(kind="error", message=f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        edges.close(linger=0)
        replies.close(linger=2000)
        sctx.term()
        actx.term()


async def _watch_parent(parent_pid: int, scope: anyio.CancelScope) -> None:
    """Exit when the parent dies (killed without a chance to stop us): never sample orphaned."""
    if not parent_pid:
        return
    while True:
        await anyio.sleep(0.5)
        if os.getppid() != parent_pid:
            logger.warning("parent process %d is gone; stopping", parent_pid)
            scope.cancel()
            return


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="zeus-async sampler: %(message)s")
    cfg = msgspec.json.decode(sys.argv[1], type=ChildConfig)
    anyio.run(_run, cfg, backend="asyncio")


if __name__ == "__main__":
    main()
