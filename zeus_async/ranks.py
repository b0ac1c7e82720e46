"""Which rank of a distributed job this process is, from the launcher's environment.

Launchers say it in environment variables, each in its own: torchrun and Hugging Face
accelerate (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``), PyTorch Lightning's
``ddp`` launcher (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``; the global rank only in its
child processes' ``RANK``), Slurm (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``,
``SLURM_NODEID``) and Open MPI (``OMPI_COMM_WORLD_*``). :func:`rank_info` reads them, first
match wins, so that a rank's :class:`~zeus_async.Monitor` measures its own GPU and writes its own
files without being told.

Paths given to ``Monitor(record=, log_file=)`` and ``GlobalPowerLimitOptimizer(profile_path=)``
may hold ``{rank}``, ``{local_rank}``, ``{world_size}``, ``{node}`` and ``{host}``
(:func:`rank_path`); a path without them, used on every rank of a job, gets the rank inserted
before its suffix (``run.zarc`` → ``run.rank1.zarc``), so ranks never write into one file.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .aggregate.windows import WindowResult
    from .carbon import Footprint

__all__ = [
    "PLACEHOLDERS",
    "Collectives",
    "RankInfo",
    "collective_device",
    "collectives",
    "job_energy",
    "job_footprint",
    "rank_info",
    "rank_path",
]

logger = logging.getLogger(__name__)

#: The placeholders :func:`rank_path` fills in.
PLACEHOLDERS = ("rank", "local_rank", "world_size", "node", "host")

# (global rank, local rank, world size, node) variables of each launcher, in order of trust:
# torchrun and accelerate (node: GROUP_RANK), Lightning's children (node: NODE_RANK), Slurm,
# Open MPI.
_LAUNCHERS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE", ("GROUP_RANK", "NODE_RANK")),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", ("SLURM_NODEID",)),
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_NODE_RANK",),
    ),
)


@dataclass(frozen=True)
class RankInfo:
    """This process's place in a job (a single process: rank 0 of 1).

    Attributes:
        rank: Global rank.
        local_rank: Rank on this node (its GPU, usually).
        world_size: Ranks in the job.
        node: The node's index in the job (``None`` when the launcher does not say).
        host: This machine's host name.
        launcher: Which variables said so (``"RANK"``, ``"SLURM_PROCID"``, ...; ``""`` alone).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node: int | None = None
    host: str = ""
    launcher: str = ""

    @property
    def distributed(self) -> bool:
        """More than one rank."""
        return self.world_size > 1

    def as_meta(self) -> dict[str, str]:
        """Run metadata (recording header, stream info) naming this rank."""
        if not self.distributed:
            return {}
        meta = {
            "rank": str(self.rank),
            "local_rank": str(self.local_rank),
            "world_size": str(self.world_size),
        }
        if self.node is not None:
            meta["node"] = str(self.node)
        return meta


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"${name} must be a whole number, not {text!r}") from None


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank, local rank, world size and node, from the launcher's variables.

    Raises:
        ConfigError: A launcher variable that is not a whole number.
    """
    env = os.environ if env is None else env
    host = socket.gethostname()
    for rank_var, local_var, size_var, node_vars in _LAUNCHERS:
        rank, local = _int(env, rank_var), _int(env, local_var)
        size = _int(env, size_var)
        if rank is None or size is None:
            continue
        node = next((n for n in map(lambda v: _int(env, v), node_vars) if n is not None), None)
        return RankInfo(
            rank=rank,
            local_rank=rank if local is None else local,
            world_size=size,
            node=node,
            host=host,
            launcher=rank_var,
        )
    # Lightning's launching process: LOCAL_RANK and NODE_RANK, no global rank yet.
    local, size = _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE")
    if local is not None:
        return RankInfo(
            rank=local,
            local_rank=local,
            world_size=size or 1,
            node=_int(env, "NODE_RANK"),
            host=host,
            launcher="LOCAL_RANK",
        )
    return RankInfo(host=host)


def rank_path(
    path: str | os.PathLike[str], info: RankInfo | None = None, *, per_rank: bool = True
) -> Path:
    """``path`` for this rank: its placeholders filled in, or, in a job of several ranks, the
    rank inserted before the suffix when it has none (``run.zarc`` → ``run.rank1.zarc``;
    not with ``per_rank=False``, for a file of the whole job that one rank writes).

    Raises:
        ConfigError: An unknown placeholder, or a malformed one (``{rank``).
    """
    info = rank_info() if info is None else info
    text = os.fspath(path)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"{text!r}: {exc} (placeholders: {_names()})") from None
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        raise ConfigError(f"{text!r}: unknown placeholder {{{unknown[0]}}} (known: {_names()})")
    if fields:
        node = "" if info.node is None else str(info.node)
        return Path(
            text.format(
                rank=info.rank,
                local_rank=info.local_rank,
                world_size=info.world_size,
                node=node or info.host,
                host=info.host,
            )
        )
    out = Path(text)
    if not info.distributed or not per_rank:
        return out
    suffix = "".join(out.suffixes[-1:])
    named = out.with_name(f"{out.name[: len(out.name) - len(suffix)]}.rank{info.rank}{suffix}")
    logger.info("rank %d of %d writes %s (for %s)", info.rank, info.world_size, named, out)
    return named


def _names() -> str:
    return ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)


# -- collectives ----------------------------------------------------------------------------


def collective_device(backend: str, current_cuda_device: int | None) -> str:
    """The device of the tensors a process group's collectives need: ``"cpu"`` when its
    backend runs CPU collectives (gloo, MPI, UCC, or a mixed ``cpu:gloo,cuda:nccl``), else
    ``"cuda:N"`` on this rank's current CUDA device (NCCL only: Hugging Face/accelerate's and
    Lightning's groups on GPUs, which have no CPU collectives).

    Raises:
        ConfigError: An NCCL-only group on a rank without CUDA.
    """
    parts = [p.strip().lower() for p in backend.split(",") if p.strip()]
    for part in parts:
        device, _, name = part.rpartition(":")
        if device in ("", "cpu") and name in ("gloo", "mpi", "ucc"):
            return "cpu"
    if current_cuda_device is None:
        raise ConfigError(
            f"the process group's backend {backend!r} has no CPU collectives and this rank "
            "has no CUDA device"
        )
    return f"cuda:{current_cuda_device}"


class Collectives:
    """A few collectives over ``torch.distributed``'s default group, with tensors on the
    device its backend needs. Every rank calls each method at the same point of its program
    (the same training step), as with any collective."""

    def __init__(self, torch: Any, dist: Any) -> None:
        self._torch = torch
        self._dist = dist
        cuda = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.device = torch.device(collective_device(str(dist.get_backend()), cuda))
        self.world_size = int(dist.get_world_size())
        self.rank = int(dist.get_rank())

    def _reduce(self, values: list[float], op: str) -> list[float]:
        tensor = self._torch.tensor(values, dtype=self._torch.float64, device=self.device)
        self._dist.all_reduce(tensor, op=getattr(self._dist.ReduceOp, op))
        return [float(v) for v in tensor.tolist()]

    def combine(self, energy: float, elapsed: float, failed: bool) -> tuple[float, float, bool]:
        """Energy summed, time the maximum, and whether any rank had no measurement."""
        summed = self._reduce([0.0 if failed else energy, 1.0 if failed else 0.0], "SUM")
        (longest,) = self._reduce([0.0 if failed else elapsed], "MAX")
        return summed[0], longest, summed[1] > 0

    def total(self, count: int) -> int:
        """The sum of every rank's ``count``."""
        return round(self.sum(float(count)))

    def sum(self, value: float) -> float:
        """The sum of every rank's ``value``."""
        return self._reduce([value], "SUM")[0]

    def sums(self, values: list[float]) -> list[float]:
        """Element by element, the sum of every rank's ``values`` (one collective)."""
        return self._reduce(values, "SUM")


def collectives() -> Collectives | None:
    """With ``torch.distributed`` initialized (several ranks): its :class:`Collectives`;
    ``None`` in a single process. Look it up when you need it, not once at start: a framework
    may create its process group late (Lightning inside ``trainer.fit()``)."""
    if "torch" not in sys.modules:
        return None  # torch.distributed cannot be initialized without torch imported
    try:
        torch: Any = importlib.import_module("torch")
        dist: Any = importlib.import_module("torch.distributed")
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return Collectives(torch, dist)


def job_energy(result: WindowResult, timeout: float | None = None) -> float:
    """Joules of a window over every rank's GPUs: one figure for the whole job.

    A collective: every rank calls it for the same window, at the same point of its program
    (after ending the window, as the training step's own collectives are). Waits for this
    rank's figure (``timeout``), then sums over the ranks; in a single process, this rank's
    GPU energy.

    Raises:
        Whatever :meth:`WindowResult.wait` raises (a measurement that failed); the other ranks
        then wait at the collective until the process group's timeout, so call it where a
        failure ends the job anyway, or catch it on every rank.
    """
    joules = sum(result.wait(timeout).gpu_energy_j.values())
    ranks = collectives()
    return joules if ranks is None else ranks.sum(joules)


def job_footprint(result: WindowResult, timeout: float | None = None) -> Footprint | None:
    """The footprint of a window over every rank's GPUs (:attr:`WindowResult.gpu_footprint
    <zeus_async.aggregate.WindowResult.gpu_footprint>` summed): what :func:`job_energy` is
    for joules, with grams CO2e, cost, the intensity's source, the PUE and the overhead.

    A collective, as :func:`job_energy`: every rank calls it for the same window, at the same
    point of its program. ``None`` on every rank when this rank's monitor has no carbon
    configuration (every rank's must have the same one); the cost is ``None`` when a rank's
    is. In a single process, this rank's GPU footprint.
    """
    import msgspec

    result.wait(timeout)
    own = result.gpu_footprint
    ranks = collectives()
    if ranks is None:
        return own
    has = own is not None
    priced = has and own is not None and own.cost is not None
    values = [
        1.0 if has else 0.0,
        1.0 if priced else 0.0,
        own.energy_j if own is not None else 0.0,
        own.kwh if own is not None else 0.0,
        own.co2e_g if own is not None else 0.0,
        own.cost if own is not None and own.cost is not None else 0.0,
    ]
    has_n, priced_n, energy, kwh, co2e, cost = ranks.sums(values)
    if own is None or round(has_n) < ranks.world_size:
        if own is not None:
            logger.warning("job_footprint: some ranks have no carbon configuration")
        return None
    whole = round(priced_n) == ranks.world_size
    return msgspec.structs.replace(
        own,
        energy_j=energy,
        kwh=kwh,
        co2e_g=co2e,
        cost=cost if whole else None,
        currency=own.currency if whole else "",
        g_per_kwh=co2e / kwh if kwh > 0 else own.g_per_kwh,
    )
