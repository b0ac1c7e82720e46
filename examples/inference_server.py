"""Energy per request in a small dynamic-batching inference server, on a simulated GPU.

A tiny causal language model (torch, built in code: no download) serves requests that a load
generator sends at random: each has a prompt (prefill) and generates tokens one step at a time
(decode). The server batches every request in flight into each forward pass, as serving
engines do, and drives the simulated GPU's load with the batch: busy while a step computes, in
proportion to the tokens it processes, idle between steps.

Three request meters read the same GPU readings and the same request edges: equal shares,
token-weighted within each phase, and ``steps``, which the server also tells what each forward
pass computed (``meter.step``: the requests in the batch, their prefill and decode tokens and
context), so each pass's energy goes to the requests in it by their work. At the end the script
prints, per request, its energy under each, prefill and decode energy and J per output token
(token meter), then per GPU the measured energy and where it went (requests + idle =
measured).

    python examples/inference_server.py [--seconds 5] [--rate 20] [--record run.zarc]

With ``--record``, the GPU readings and the token meter's ``request`` and ``request_idle``
events go to a recording (``zeus-async inspect run.zarc`` summarizes the requests).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time
from dataclasses import dataclass, field

import anyio
import torch

from zeus_async.devices.sim import SimConfig
from zeus_async.devices.sim_workload import ConstantWorkload
from zeus_async.inference import RequestEnergy, RequestMeter, StepEntry
from zeus_async.runtime import Runtime
from zeus_async.testing import sim_pynvml

logger = logging.getLogger("inference_server")

#: One simulated GPU with fast readings (energy counter and power every 5 ms).
SIM = SimConfig(
    num_gpus=1,
    idle_w=80.0,
    max_w=700.0,
    counter_period_s=0.005,
    instant_period_s=0.005,
    instant_window_s=0.005,
    workload=ConstantWorkload(util=0.0),
)


#: Tokens a decode step reads of each sequence.
CONTEXT = 16


class TinyLM(torch.nn.Module):
    """A two-layer causal transformer over a 256-token vocabulary."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.head(self.body(self.embed(tokens), mask=mask))[:, -1]


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new: int
    generated: list[int] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)


async def serve(
    queue: anyio.abc.ObjectReceiveStream[Request],
    meters: list[RequestMeter],
    model: TinyLM,
) -> None:
    """The batching loop: admit waiting requests, prefill them, decode everyone a step."""
    node = sim_pynvml.current_node()
    assert node is not None
    gpu = node.gpus[0]
    active: list[Request] = []
    while True:
        while True:  # admit what has arrived
            try:
                req = queue.receive_nowait()
            except anyio.WouldBlock:
                break
            except anyio.EndOfStream:
                if not active:
                    return
                break
            for m in meters:
                m.begin(req.request_id, gpus=(0,))
            active.append(req)
            # Prefill the prompt (a forward over all of it) before it joins the decode batch.
            t0 = time.time_ns()
            await step(gpu, model, [req.prompt], load=min(1.0, 0.2 + len(req.prompt) / 200))
            batch = [StepEntry(req.request_id, prefill_tokens=len(req.prompt))]
            for m in meters:  # what the pass computed (only the steps policy uses it)
                m.step(batch, start_ns=t0, end_ns=time.time_ns(), gpus=(0,))
            req.generated.append(0)
            for m in meters:
                m.phase(req.request_id)
        if not active:
            await anyio.sleep(0.002)
            continue
        # One decode step for the whole batch (over each sequence's last tokens only: a toy
        # model's stand-in for the KV cache that spares real engines the whole sequence).
        recent = [(r.prompt + r.generated)[-CONTEXT:] for r in active]
        t0 = time.time_ns()
        await step(gpu, model, recent, load=0.1 * len(active))
        batch = [
            StepEntry(r.request_id, decode_tokens=1, context_len=len(r.prompt) + len(r.generated))
            for r in active
        ]
        for m in meters:
            m.step(batch, start_ns=t0, end_ns=time.time_ns(), gpus=(0,))
        for r in list(active):
            r.generated.append(random.randrange(256))
            if len(r.generated) >= r.max_new:
                active.remove(r)
                for m in meters:
                    m.end(r.request_id, tokens_in=len(r.prompt), tokens_out=len(r.generated))
                r.done.set()


def forward(model: TinyLM, batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # per thread: entered where the pass runs
        return model(batch)


async def step(gpu: object, model: TinyLM, seqs: list[list[int]], load: float) -> None:
    """One forward pass; the simulated GPU is busy (at ``load``) while it runs.

    The pass runs on a worker thread, as a serving engine keeps its event loop free: arrivals,
    the request meters and the sampler (on this same loop) go on while it computes (torch
    releases the GIL in its kernels). Run on the loop itself, it delayed everything else: 22
    requests served in 14 s where 100 arrive in 5 s.
    """
    width = max(len(s) for s in seqs)
    batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    gpu.set_load(min(load, 1.0))  # type: ignore[attr-defined]
    await anyio.to_thread.run_sync(forward, model, batch)
    await anyio.sleep(0.004)  # the kernels' time on the (simulated) device
    gpu.set_load(0.0)  # type: ignore[attr-defined]
    await anyio.sleep(0)


async def generate(
    send: anyio.abc.ObjectSendStream[Request], seconds: float, rate: float, seed: int
) -> list[Request]:
    """Poisson arrivals: prompts of 8-120 tokens, 4-40 tokens to generate."""
    rng = random.Random(seed)
    sent: list[Request] = []
    end = time.monotonic() + seconds
    async with send:
        while time.monotonic() < end:
            await anyio.sleep(rng.expovariate(rate))
            req = Request(
                f"req-{len(sent)}",
                [rng.randrange(256) for _ in range(rng.randrange(8, 120))],
                rng.randrange(4, 40),
            )
            sent.append(req)
            await send.send(req)
    for req in sent:
        await req.done.wait()
    return sent


async def main_async(
    seconds: float, rate: float, record: str | None = None
) -> tuple[list[RequestMeter], int]:
    meters = [
        RequestMeter("equal", gpus=[0], lag_s=0.05),
        RequestMeter("tokens", gpus=[0], lag_s=0.05),
        RequestMeter("steps", gpus=[0], lag_s=0.05),
    ]

    async def feed(stream: anyio.abc.ObjectReceiveStream[object]) -> None:
        async for event in stream:
            for m in meters:
                m.add(event)  # type: ignore[arg-type]

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core for the passes, the other for the loop and sampler
    model = TinyLM().eval()
    async with Runtime(
        backend="sim",
        sim_config=SIM,
        period_s=0.005,
        cpus=None,
        consumers=[feed],
        record=record,
        overwrite=True,
    ) as rt:
        meters[1].publish_with(rt.publish_nowait, host=rt.host)
        await anyio.sleep(0.2)  # readings before the first request
        send, receive = anyio.create_memory_object_stream[Request](1000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve, receive, meters, model)
            sent = await generate(send, seconds, rate, seed=1)
        await anyio.sleep(0.3)  # readings past the last request
        for m in meters:
            m.settle()
    return meters, len(sent)


def report(meters: list[RequestMeter], shown: int = 12) -> None:
    equal, tokens, steps = ({r.request_id: r for r in m.results()} for m in meters)
    print(
        f"{'request':<10}{'in':>5}{'out':>5}{'time s':>8}{'J (equal)':>11}{'J (tokens)':>12}"
        f"{'J (steps)':>11}{'prefill J':>11}{'decode J':>10}{'J/token':>9}"
    )
    for rid in list(tokens)[:shown]:
        t, e, st = tokens[rid], equal[rid], steps[rid]
        print(
            f"{rid:<10}{t.tokens_in:>5}{t.tokens_out:>5}{t.time_s:>8.3f}{e.energy_j:>11.3f}"
            f"{t.energy_j:>12.3f}{st.energy_j:>11.3f}{t.prefill_j or 0:>11.3f}"
            f"{t.decode_j or 0:>10.3f}{t.j_per_output_token or math.nan:>9.3f}"
        )
    if len(tokens) > shown:
        print(f"... and {len(tokens) - shown} more")
    for m in meters:
        tot = m.totals
        measured, requests, idle = tot.energy_j[0], tot.requests_j[0], tot.idle_j[0]
        per_token = [r.j_per_output_token for r in m.results() if r.j_per_output_token]
        print(
            f"{m.policy:>6}: gpu:0 measured {measured:.2f} J = requests {requests:.2f} J + idle "
            f"{idle:.2f} J (off by {measured - requests - idle:.2e} J); {tot.requests} requests, "
            f"median {sorted(per_token)[len(per_token) // 2]:.3f} J per output token"
        )


def summarize(results: list[RequestEnergy]) -> float:
    return math.fsum(r.energy_j for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="how long requests arrive")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--record", default=None, help="record readings and request events")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    meters, n = anyio.run(main_async, args.seconds, args.rate, args.record)
    print(f"served {n} requests on one simulated GPU")
    report(meters)


if __name__ == "__main__":
    main()
