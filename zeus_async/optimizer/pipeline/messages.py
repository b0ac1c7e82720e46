"""Records of pipeline frequency optimization (PFO), shared by the server, schedulers and client.

Semantics of Zeus's pipeline frequency optimizer (seed 003), as msgspec structs: every field is
checked when a message is decoded (``msgspec.ValidationError`` names the field), and the
cross-field rules (``world_size == pp * dp * tp``, matching time/energy keys, ...) are checked
both when decoding and when constructing.

State dumps (ranks, schedules, profiling results) are JSON files written with aiofiles by the
server; the ``load_*`` functions read them back. An :class:`InstructionProfilingResult` is written
as CSV (``to_csv``) and read back with :meth:`InstructionProfilingResult.from_csv`.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar

import aiofiles
import aiofiles.os
import msgspec

from ...errors import ConfigError

__all__ = [
    "CSV_COLUMNS",
    "FrequencySchedule",
    "InstructionProfilingResult",
    "JobInfo",
    "OfflineProfilingResult",
    "ProfilingResult",
    "RankInfo",
    "load_prof",
    "load_ranks",
    "load_sched",
    "save_prof",
    "save_ranks",
    "save_sched",
]

logger = logging.getLogger(__name__)

PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
MHz = Annotated[int, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]

#: The most SM clocks a rank may register (GPUs list a few hundred at most): a bound on what
#: one registration can make the server hold.
MAX_CLOCKS = 1024

#: Columns of an instruction profile CSV, in order.
CSV_COLUMNS = (
    "rank",
    "dp_rank",
    "pp_rank",
    "tp_rank",
    "stage",
    "instruction",
    "frequency",
    "time",
    "energy",
)
INSTRUCTIONS = ("forward", "backward")


def _finite_nonneg(what: str, values: Iterable[float]) -> None:
    for v in values:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{what} must be finite and >= 0, got {v!r}")


class JobInfo(msgspec.Struct, kw_only=True):
    """A training job, as rank 0 registers it.

    Attributes:
        pp_degree: Pipeline-parallel degree (>= 1).
        dp_degree: Data-parallel degree (>= 1).
        tp_degree: Tensor-parallel degree (>= 1).
        world_size: Number of ranks; must equal ``pp_degree * dp_degree * tp_degree``.
        job_id: Empty when registering; the server assigns
            ``<date-time>+dp<D>+pp<P>+tp<T>+<scheduler>[+<job_metadata>]``.
        job_metadata: Optional free text appended to the job id.
    """

    pp_degree: PosInt
    dp_degree: PosInt
    tp_degree: PosInt
    world_size: PosInt
    job_id: str = ""
    job_metadata: str | None = None

    def __post_init__(self) -> None:
        for name in ("pp_degree", "dp_degree", "tp_degree", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                # msgspec checks types when decoding; a direct JobInfo(...) does not.
                raise ConfigError(f"{name} must be a whole number, not {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.pp_degree * self.dp_degree * self.tp_degree
        if product != self.world_size:
            raise ValueError(
                f"world_size ({self.world_size}) must equal pp_degree * dp_degree * tp_degree "
                f"({self.pp_degree} * {self.dp_degree} * {self.tp_degree} = {product})"
            )
        if self.job_metadata is not None and "/" in self.job_metadata:
            raise ValueError("job_metadata may not contain '/' (it becomes part of a path)")

    def make_job_id(self, scheduler_name: str, now: datetime | None = None) -> str:
        """The id the server gives this job (see the class docstring)."""
        parts = [
            (now or datetime.now()).strftime("%Y-%m-%d-%H-%M-%S"),
            f"dp{self.dp_degree}",
            f"pp{self.pp_degree}",
            f"tp{self.tp_degree}",
            scheduler_name,
        ]
        if self.job_metadata:
            parts.append(self.job_metadata)
        return "+".join(parts)


class RankInfo(msgspec.Struct, kw_only=True):
    """One rank, as it registers with the server: its ranks and its GPU's SM clocks (MHz)."""

    rank: NonNegInt
    dp_rank: NonNegInt
    pp_rank: NonNegInt
    tp_rank: NonNegInt
    available_frequencies: Annotated[list[MHz], msgspec.Meta(max_length=MAX_CLOCKS)]

    def __post_init__(self) -> None:
        for name in ("rank", "dp_rank", "pp_rank", "tp_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.available_frequencies or min(self.available_frequencies) <= 0:
            raise ValueError("available_frequencies must be a non-empty list of positive MHz")
        if len(self.available_frequencies) > MAX_CLOCKS:
            raise ValueError(f"available_frequencies lists over {MAX_CLOCKS} clocks")

    def check_against(self, job: JobInfo) -> None:
        """Raise ``ValueError`` when this rank cannot belong to ``job``."""
        for name, limit in (
            ("rank", job.world_size),
            ("dp_rank", job.dp_degree),
            ("pp_rank", job.pp_degree),
            ("tp_rank", job.tp_degree),
        ):
            if getattr(self, name) >= limit:
                raise ValueError(f"{name} {getattr(self, name)} is out of range (< {limit})")


class FrequencySchedule(msgspec.Struct, kw_only=True):
    """The SM clock (MHz) for each instruction of one iteration of a rank, in execution order."""

    rank: NonNegInt
    frequencies: list[tuple[str, MHz]]

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        for name, freq in self.frequencies:
            if not name or freq <= 0:
                raise ValueError(f"invalid schedule entry ({name!r}, {freq!r})")


class ProfilingResult(msgspec.Struct, kw_only=True):
    """What a rank measured while running one schedule.

    Attributes:
        rank: Global rank.
        iter_time: Seconds of each profiled iteration.
        iter_energy: Joules of each profiled iteration (the rank's GPU).
        time_breakdown: Instruction name -> per iteration, the seconds of each occurrence
            (``time_breakdown["forward"][i]`` lists the forwards of iteration ``i``).
        energy_breakdown: The same shape, in joules.
    """

    rank: NonNegInt
    iter_time: list[NonNegFloat]
    iter_energy: list[NonNegFloat]
    time_breakdown: dict[str, list[list[NonNegFloat]]] = {}
    energy_breakdown: dict[str, list[list[NonNegFloat]]] = {}

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if len(self.iter_time) != len(self.iter_energy):
            raise ValueError(
                f"iter_time has {len(self.iter_time)} iterations but iter_energy "
                f"{len(self.iter_energy)}"
            )
        _finite_nonneg("iter_time", self.iter_time)
        _finite_nonneg("iter_energy", self.iter_energy)
        if set(self.time_breakdown) != set(self.energy_breakdown):
            raise ValueError("time_breakdown and energy_breakdown must name the same instructions")
        for key, times in self.time_breakdown.items():
            energies = self.energy_breakdown[key]
            if [len(t) for t in times] != [len(e) for e in energies]:
                raise ValueError(f"time and energy breakdowns of {key!r} differ in shape")
            for t, e in zip(times, energies, strict=True):
                _finite_nonneg(f"time_breakdown[{key!r}]", t)
                _finite_nonneg(f"energy_breakdown[{key!r}]", e)


class OfflineProfilingResult(msgspec.Struct, kw_only=True):
    """Mean time (s) and energy (J) of one forward and one backward per SM clock (MHz)."""

    rank: NonNegInt
    dp_rank: NonNegInt
    pp_rank: NonNegInt
    tp_rank: NonNegInt
    forward_time: dict[int, NonNegFloat]
    forward_energy: dict[int, NonNegFloat]
    backward_time: dict[int, NonNegFloat]
    backward_energy: dict[int, NonNegFloat]

    def __post_init__(self) -> None:
        for instr in INSTRUCTIONS:
            times: dict[int, float] = getattr(self, f"{instr}_time")
            energies: dict[int, float] = getattr(self, f"{instr}_energy")
            if set(times) != set(energies):
                raise ValueError(f"{instr}_time and {instr}_energy must have the same clocks")
            _finite_nonneg(f"{instr}_time", times.values())
            _finite_nonneg(f"{instr}_energy", energies.values())


class InstructionProfilingResult(msgspec.Struct):
    """Time and energy of each instruction of each stage at each profiled SM clock."""

    results: list[OfflineProfilingResult]

    def rows(self) -> list[tuple[int, int, int, int, int, str, int, float, float]]:
        """The CSV rows (see :data:`CSV_COLUMNS`); ``stage`` is always ``pp_rank``."""
        out: list[tuple[int, int, int, int, int, str, int, float, float]] = []
        for r in self.results:
            prefix = (r.rank, r.dp_rank, r.pp_rank, r.tp_rank, r.pp_rank)
            for freq in r.forward_time:
                out.append((*prefix, "forward", freq, r.forward_time[freq], r.forward_energy[freq]))
            for freq in r.backward_time:
                out.append(
                    (*prefix, "backward", freq, r.backward_time[freq], r.backward_energy[freq])
                )
        return out

    def to_csv_text(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        for row in self.rows():
            writer.writerow([repr(v) if isinstance(v, float) else v for v in row])
        return buf.getvalue()

    def to_csv(self, filepath: str | os.PathLike[str]) -> None:
        """Write the profile as CSV (columns :data:`CSV_COLUMNS`; ``filepath`` ends in .csv).

        ``time`` and ``energy`` are means over the profiled iterations; all ranks and ``stage``
        are zero-based; ``instruction`` is ``forward`` or ``backward``.
        """
        path = _csv_path(filepath)
        path.write_text(self.to_csv_text(), encoding="utf-8")

    @classmethod
    def from_csv_text(cls, text: str, *, source: str = "<text>") -> InstructionProfilingResult:
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != CSV_COLUMNS:
            raise ValueError(f"{source}: expected the header {','.join(CSV_COLUMNS)}")
        by_rank: dict[tuple[int, int, int, int], dict[str, dict[int, float]]] = {}
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != len(CSV_COLUMNS):
                raise ValueError(f"{source}:{lineno}: expected {len(CSV_COLUMNS)} columns")
            try:
                rank, dp, pp, tp, stage, freq = (int(row[i]) for i in (0, 1, 2, 3, 4, 6))
                time_s, energy_j = float(row[7]), float(row[8])
            except ValueError as exc:
                raise ValueError(f"{source}:{lineno}: {exc}") from None
            instr = row[5]
            if instr not in INSTRUCTIONS:
                raise ValueError(f"{source}:{lineno}: unknown instruction {instr!r}")
            if stage != pp:
                raise ValueError(f"{source}:{lineno}: stage {stage} differs from pp_rank {pp}")
            tables = by_rank.setdefault((rank, dp, pp, tp), {})
            times = tables.setdefault(f"{instr}_time", {})
            if freq in times:
                raise ValueError(
                    f"{source}:{lineno}: a second row for rank {rank} {instr} at {freq} MHz"
                )
            times[freq] = time_s
            tables.setdefault(f"{instr}_energy", {})[freq] = energy_j
        results = []
        for (rank, dp, pp, tp), tables in sorted(by_rank.items()):
            fields = {
                f"{i}_{k}": tables.get(f"{i}_{k}", {})
                for i in INSTRUCTIONS
                for k in ("time", "energy")
            }
            try:
                results.append(
                    OfflineProfilingResult(rank=rank, dp_rank=dp, pp_rank=pp, tp_rank=tp, **fields)
                )
            except ValueError as exc:
                raise ValueError(f"{source}: rank {rank}: {exc}") from None
        return cls(results)

    @classmethod
    def from_csv(cls, filepath: str | os.PathLike[str]) -> InstructionProfilingResult:
        """Read a profile written by :meth:`to_csv`."""
        path = _csv_path(filepath)
        return cls.from_csv_text(path.read_text(encoding="utf-8"), source=str(path))


def _csv_path(filepath: str | os.PathLike[str]) -> Path:
    path = Path(filepath)
    if path.suffix != ".csv":
        raise ValueError(f"instruction profile path must end in '.csv': {str(path)!r}")
    return path


# -- state dumps ---------------------------------------------------------------------------------

T = TypeVar("T")
_json = msgspec.json.Encoder()


async def _dump(obj: Any, path: Path) -> None:
    await aiofiles.os.makedirs(path.parent, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    async with aiofiles.open(tmp, "wb") as f:
        await f.write(_json.encode(obj))
    await aiofiles.os.replace(tmp, path)


def _load(path: Path, type_: type[T]) -> T:
    try:
        return msgspec.json.decode(path.read_bytes(), type=type_)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: {exc}") from None


async def save_prof(
    data: Sequence[ProfilingResult], directory: str | os.PathLike[str], schedule_num: int
) -> None:
    """Write the profiling results of schedule ``schedule_num`` to ``<dir>/<n>.prof.json``."""
    await _dump(list(data), Path(directory) / f"{schedule_num}.prof.json")


def load_prof(directory: str | os.PathLike[str], schedule_num: int) -> list[ProfilingResult]:
    return _load(Path(directory) / f"{schedule_num}.prof.json", list[ProfilingResult])


async def save_sched(
    data: Sequence[FrequencySchedule], directory: str | os.PathLike[str], schedule_num: int
) -> None:
    """Write the schedules of round ``schedule_num`` to ``<dir>/<n>.sched.json``."""
    await _dump(list(data), Path(directory) / f"{schedule_num}.sched.json")


def load_sched(directory: str | os.PathLike[str], schedule_num: int) -> list[FrequencySchedule]:
    return _load(Path(directory) / f"{schedule_num}.sched.json", list[FrequencySchedule])


async def save_ranks(data: Sequence[RankInfo], directory: str | os.PathLike[str]) -> None:
    """Write the job's ranks to ``<dir>/ranks.json``."""
    await _dump(list(data), Path(directory) / "ranks.json")


def load_ranks(directory: str | os.PathLike[str]) -> list[RankInfo]:
    return _load(Path(directory) / "ranks.json", list[RankInfo])
