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

import logging
import os
import socket
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

__all__ = ["PLACEHOLDERS", "RankInfo", "rank_info", "rank_path"]

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
