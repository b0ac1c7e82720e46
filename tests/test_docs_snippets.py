"""Every ```python block of README.md and docs/*.md runs (issue 34 item 6).

Each block runs in a process of its own, on the simulated GPUs that ``auto`` falls back to
without an NVIDIA driver, from a fresh directory, as a new user would run it; it fails the test
if it raises. What a block leaves to the reader (the training loop's ``epochs`` and ``loader``,
a Hugging Face ``model``, a recording ``run.zarc``, a PFO server, ...) is defined first by a
small **prelude** with real objects: the marker just above the block in the markdown,
``<!-- snippet: NAME -->``, names it (:data:`PRELUDES`). A block that cannot run here is
marked ``<!-- snippet: not run: WHY -->`` and reported as skipped with that reason; today every
block runs. A block with neither marker fails :func:`test_every_block_is_marked`.

Tracebacks name the markdown file and the block's own line numbers in it. A block that binds
a fixed port (``tcp://127.0.0.1:5555``, as the README's ``subscribe`` command connects to) is
skipped, saying so, only when something else on this machine holds that port.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARK = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->")
NOT_RUN = re.compile(r"not run\s*[:—-]\s*(.+)")
#: Modules ``.ci/run`` installs and requires (msgpack: the test extra; elsewhere a block needing
#: one is skipped).
REQUIRED_IN_CI = ("torch", "transformers", "lightning", "msgpack")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and its marker (``None``: unmarked)."""

    doc: Path
    line: int  # the opening fence's line (1-based): the code starts on the next one
    code: str
    mark: str | None

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
                mark = MARK.fullmatch(above.strip())
                code = "\n".join(lines[i + 1 : end]) + "\n"
                out.append(Block(doc, i + 1, code, mark.group(1) if mark else None))
                i = end
            i += 1
    return out


@dataclass(frozen=True)
class Prelude:
    """What runs before a block, in its process: the names it leaves to the reader."""

    code: str
    #: Modules the block needs beyond the core dependencies.
    needs: tuple[str, ...] = ()
    #: Start a ``pfo-server`` (the planner, 2 microbatches) and give its endpoint as ``{url}``.
    pfo_server: bool = False
    #: Checks what the block printed (stdout) and left in its directory.
    check: Callable[[str, Path], None] | None = None


TRAINING = """
import time

epochs = 2                       # a short training run: 2 epochs of 20 steps of 5 ms
loader = range(20)

def train_step(batch):
    time.sleep(0.005)

def train():
    for _ in range(epochs):
        for batch in loader:
            train_step(batch)
"""

# The power-limit optimizer profiles 21 limits (700 W down to 200 W, 25 W apart) for 10 warm-up
# and 40 profiled steps each: about 1,050 steps. 2,000 steps of 1 ms run them, and leave the
# last limit's measurement time to come in before the block prints the choice.
POWER_LIMIT_TRAINING = """
import time

epochs = 2                       # 2 epochs of 1,000 steps of 1 ms: the optimizer needs ~1,050
loader = range(1000)

def train_step(batch):
    time.sleep(0.001)
"""

# A linear regression, as a Hugging Face model (it returns its loss) and as a LightningModule;
# 64 examples of 8 features, 8 steps of 8. Nothing is downloaded.
FRAMEWORKS = """
import torch
import lightning as L
from transformers import Trainer, TrainingArguments
from zeus_async import Monitor

class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}

class LitRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def training_step(self, batch, index):
        return torch.nn.functional.mse_loss(self.linear(batch["x"]).squeeze(-1), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

features = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
data = [{"x": x, "y": x.sum()} for x in features]
model, lit_model = Regressor(), LitRegressor()
args = TrainingArguments(output_dir="hf", max_steps=8, per_device_train_batch_size=8,
                         logging_steps=4, report_to=[], save_strategy="no", use_cpu=True)
loader = torch.utils.data.DataLoader(data, batch_size=8)
monitor = Monitor()
"""

RECORDING = """
import time
from zeus_async import Monitor
from zeus_async.store.analysis import Recording as _Recording

# run.zarc: 0.6 s of the simulated GPUs, a window per 0.2 s step
with Monitor(record="run.zarc") as _monitor:
    for _ in range(3):
        with _monitor.window("step"):
            time.sleep(0.2)
t0_ns = _Recording("run.zarc").start_ns + 100_000_000   # 0.1 s to 0.4 s into it
t1_ns = t0_ns + 300_000_000
"""

# A small convolutional net, trained on random images for 1.5 s (the process sampler reads
# every second: two samples of this process).
PROCESSES = """
import time
import torch

net = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10),
)

def train():
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        loss = net(torch.randn(4, 3, 224, 224)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""

# A job of one rank (pipeline 1 x data parallel 1) against a real pfo-server started by the
# test; the multi-rank job is tests/optimizer/pipeline/test_pfo_multirank.py's.
PFO = """
import time
from zeus_async.optimizer.pipeline import PipelineSchedule

server_url = "{url}"
rank = dp = pp = local_rank = 0
D = P = 1
my_1f1b_instructions = [name for name, _ in PipelineSchedule("1f1b", P, 2).stage_order(pp)]
loader = range(30)

def run(name):
    time.sleep(0.002)
"""

SERVING = """
import time

request_id = "req-1"

def prefill(request_id):
    time.sleep(0.05)

def decode(request_id):
    time.sleep(0.1)
"""

ASGI = """
from starlette.applications import Starlette

app = Starlette()
"""

# A runtime publishing the simulated GPUs where the subscriber connects.
WIRE_SUBSCRIBER = """
import atexit
from zeus_async.runtime import EmbeddedRuntime

atexit.register(EmbeddedRuntime(backend="auto", publish="tcp://127.0.0.1:5556").start().stop)
"""


def _prints_the_chosen_limit(out: str, cwd: Path) -> None:
    assert 200 <= int(out.splitlines()[-1]) <= 700, out
    profile = json.loads((cwd / "plo.json").read_text())
    assert [m["power_limit"] for m in profile["measurements"]] == list(range(700, 199, -25))


def _prints_the_metrics_url(out: str, cwd: Path) -> None:
    url = out.splitlines()[0]
    assert re.fullmatch(r"http://127\.0\.0\.1:[1-9][0-9]*/metrics", url), out
    assert (cwd / "run.zarc").exists()


def _prints_gpu_power(out: str, cwd: Path) -> None:
    rows = [line.split() for line in out.splitlines()]
    assert rows and all(len(row) == 3 and float(row[2]) > 0 for row in rows), out


def _prints_the_request(out: str, cwd: Path) -> None:
    first = out.splitlines()[0].split()
    assert first[0] == "req-1" and float(first[1]) > 0, out


PRELUDES: dict[str, Prelude] = {
    "standalone": Prelude(""),
    "training": Prelude(TRAINING),
    "power-limit-training": Prelude(POWER_LIMIT_TRAINING, check=_prints_the_chosen_limit),
    "frameworks": Prelude(FRAMEWORKS, needs=("torch", "transformers", "lightning")),
    "recording": Prelude(RECORDING, needs=("pandas", "pyarrow", "matplotlib")),
    "processes": Prelude(PROCESSES, needs=("torch",), check=_prints_the_metrics_url),
    "pfo": Prelude(PFO, pfo_server=True),
    "serving": Prelude(SERVING, check=_prints_the_request),
    "asgi": Prelude(ASGI, needs=("starlette",)),
    "wire-subscriber": Prelude(WIRE_SUBSCRIBER, needs=("msgpack",), check=_prints_gpu_power),
}

BLOCKS = _blocks()


def _need(module: str) -> None:
    if module in REQUIRED_IN_CI and os.environ.get("ZEUS_ASYNC_REQUIRE_FRAMEWORKS"):
        importlib.import_module(module)
    else:
        pytest.importorskip(module)


def _port_taken(port: int) -> bool:
    """Whether something listens on ``port`` (a closed one still in TIME_WAIT, as a block run
    just before leaves it, is free to ZeroMQ, which binds with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _env() -> dict[str, str]:
    """This environment, less what would make a block's run differ from a new user's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "ZEUS_ASYNC_SIM" and not k.upper().startswith("ZEUS_PFO_")
    }
    return dict(env, PYTHONUNBUFFERED="1")


@contextmanager
def _pfo_server(cwd: Path) -> Iterator[str]:
    """A real ``zeus-async pfo-server`` (the planner, for 2 microbatches) on a free port; its
    endpoint. It stops by itself after 120 s."""
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "zeus_async", "pfo-server", "--bind", "tcp://127.0.0.1:*"),
            *("--scheduler", "FrontierPlanner3D", "--scheduler-args", '{"num_microbatches": 2}'),
            *("--duration", "120"),
        ],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("zeus-async pfo-server: tcp://"), line + server.stderr.read()
        yield line.split(": ", 1)[1].split(" ", 1)[0]
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=20)


def test_every_block_is_marked() -> None:
    """A block names its prelude or says why it is not run; every prelude is used."""
    assert any(b.doc.name == "README.md" for b in BLOCKS)  # the parser finds them
    unmarked = [b.id for b in BLOCKS if b.mark is None]
    assert not unmarked, f"blocks with no <!-- snippet: ... --> marker above them: {unmarked}"
    unknown = [
        (b.id, b.mark) for b in BLOCKS if b.mark not in PRELUDES and not NOT_RUN.fullmatch(b.mark)
    ]
    assert not unknown, f"markers naming no prelude in {__file__}: {unknown}"
    assert {b.mark for b in BLOCKS} >= set(PRELUDES), "a prelude no block uses"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    from zeus_async.devices import auto_backend

    if block.mark is None:
        pytest.fail(f"{block.id}: no <!-- snippet: PRELUDE --> or <!-- snippet: not run: WHY -->")
    if block.mark not in PRELUDES:
        not_run = NOT_RUN.fullmatch(block.mark)
        assert not_run, f"{block.id}: {block.mark!r} names no prelude in {__file__}"
        pytest.skip(f"not run: {not_run.group(1)}")
    if auto_backend() != "sim":
        pytest.skip("an NVIDIA driver is present: the blocks would change real GPUs' settings")
    prelude = PRELUDES[block.mark]
    for module in prelude.needs:
        _need(module)
    for port in re.findall(r"tcp://127\.0\.0\.1:(\d+)", block.code + prelude.code):
        if _port_taken(int(port)):
            pytest.skip(f"port {port}, which the block binds, is in use on this machine")
    # The block keeps its file and line numbers, so that a traceback points into the doc.
    runner = tmp_path / "snippet.py"
    with _pfo_server(tmp_path) if prelude.pfo_server else nullcontext("") as url:
        runner.write_text(
            prelude.code.replace("{url}", url)
            + f"\nexec(compile({chr(10) * block.line + block.code!r}, {str(block.doc)!r}, "
            "'exec'))\n",
            encoding="utf-8",
        )
        proc = subprocess.run(
            [sys.executable, str(runner)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
    assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout}\n{proc.stderr}"
    if prelude.check is not None:
        prelude.check(proc.stdout, tmp_path)
