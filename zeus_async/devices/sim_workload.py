"""Workloads of the GPU simulator: utilization traces as periodic piecewise-constant profiles.

Every workload kind (idle, constant, square wave, seeded random, explicit trace) compiles to one
:class:`Profile`: a list of segment start offsets and utilization levels covering one period,
repeated forever. One representation keeps the simulator's integrals simple and *exact*: the
energy over any span is "whole periods x energy per period + two partial periods", whatever the
span's length, so ground truth over a day costs the same as over a millisecond.

Traces are pure functions of time relative to the configuration's epoch and of the seed (random
levels come from :class:`random.Random` seeded by a hash of ``(seed, gpu, kind)``, never from the
global random state), so every process that uses the same configuration sees the same trace.
"""

from __future__ import annotations

import hashlib
import logging
import random
from bisect import bisect_right
from typing import Annotated

import msgspec

from ..errors import ConfigError

__all__ = [
    "ConstantWorkload",
    "IdleWorkload",
    "Profile",
    "RandomWorkload",
    "SquareWorkload",
    "TraceWorkload",
    "Workload",
    "build_profile",
    "stable_hash",
]

logger = logging.getLogger(__name__)

UtilFrac = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]

_NS_PER_S = 1_000_000_000


class IdleWorkload(
    msgspec.Struct, tag="idle", tag_field="kind", frozen=True, forbid_unknown_fields=True
):
    """The GPU does nothing: utilization 0 at all times."""


class ConstantWorkload(
    msgspec.Struct, tag="constant", tag_field="kind", frozen=True, forbid_unknown_fields=True
):
    """Constant utilization ``util`` (0..1)."""

    util: UtilFrac = 1.0


class SquareWorkload(
    msgspec.Struct, tag="square", tag_field="kind", frozen=True, forbid_unknown_fields=True
):
    """Square wave: ``high`` for ``duty * period_s`` then ``low`` for the rest of the period.

    The wave starts (rises to ``high``) at ``epoch + phase_s + k * period_s`` for every integer k.
    """

    period_s: PosFloat = 1.0
    duty: UtilFrac = 0.5
    high: UtilFrac = 1.0
    low: UtilFrac = 0.0
    phase_s: float = 0.0


class RandomWorkload(
    msgspec.Struct, tag="random", tag_field="kind", frozen=True, forbid_unknown_fields=True
):
    """Piecewise-constant utilization, levels and segment lengths drawn from the seed.

    Segment lengths are uniform in ``[seg_min_s, seg_max_s]`` (microsecond resolution) and levels
    are drawn from ``levels``. The sequence repeats every ``repeat_s`` so that long-span energy
    stays a closed form (the last segment of a repetition is cut at ``repeat_s``).
    """

    levels: tuple[UtilFrac, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    seg_min_s: PosFloat = 0.5
    seg_max_s: PosFloat = 5.0
    repeat_s: PosFloat = 3600.0
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.levels:
            raise ConfigError("RandomWorkload.levels must not be empty")
        if self.seg_min_s < 1e-6 or self.seg_max_s < self.seg_min_s:
            raise ConfigError(
                f"RandomWorkload needs 1e-6 <= seg_min_s <= seg_max_s, got "
                f"{self.seg_min_s}..{self.seg_max_s}"
            )


class TraceWorkload(
    msgspec.Struct, tag="trace", tag_field="kind", frozen=True, forbid_unknown_fields=True
):
    """An explicit trace of ``(duration_s, util)`` segments, repeated forever."""

    segments: tuple[tuple[PosFloat, UtilFrac], ...] = ((1.0, 0.0),)
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.segments:
            raise ConfigError("TraceWorkload.segments must not be empty")


#: Every workload kind; in JSON, an object whose ``"kind"`` names the variant.
Workload = IdleWorkload | ConstantWorkload | SquareWorkload | RandomWorkload | TraceWorkload


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process (unlike :func:`hash`)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


class Profile:
    """One period of a piecewise-constant utilization trace.

    Attributes:
        offsets_ns: Start of each segment within the period; ``offsets_ns[0] == 0``, increasing.
        utils: Utilization (0..1) of each segment.
        period_ns: Length of the period.
        phase_ns: Offset of the first period start from the epoch.
    """

    __slots__ = ("offsets_ns", "period_ns", "phase_ns", "utils")

    def __init__(self, offsets_ns: list[int], utils: list[float], period_ns: int, phase_ns: int):
        if not offsets_ns or offsets_ns[0] != 0 or len(offsets_ns) != len(utils):
            raise ConfigError("profile needs segments starting at offset 0")
        if period_ns <= offsets_ns[-1]:
            raise ConfigError("profile period must extend past the last segment start")
        self.offsets_ns = offsets_ns
        self.utils = utils
        self.period_ns = period_ns
        self.phase_ns = phase_ns

    def locate(self, t_rel_ns: int) -> tuple[int, int, int]:
        """``(cycle, offset in cycle, segment index)`` of a time relative to the epoch."""
        cycle, tau = divmod(t_rel_ns - self.phase_ns, self.period_ns)
        return cycle, tau, bisect_right(self.offsets_ns, tau) - 1

    def util_at(self, t_rel_ns: int) -> float:
        """Utilization at a time relative to the epoch."""
        return self.utils[self.locate(t_rel_ns)[2]]

    def next_change_ns(self, t_rel_ns: int) -> int:
        """First segment boundary strictly after ``t_rel_ns`` (relative to the epoch)."""
        cycle, _, i = self.locate(t_rel_ns)
        base = self.phase_ns + cycle * self.period_ns
        if i + 1 < len(self.offsets_ns):
            return base + self.offsets_ns[i + 1]
        return base + self.period_ns


def _s_to_ns(seconds: float) -> int:
    return round(seconds * _NS_PER_S)


def _from_segments(durations_ns: list[int], utils: list[float], phase_ns: int) -> Profile:
    offsets: list[int] = []
    levels: list[float] = []
    t = 0
    for dur, util in zip(durations_ns, utils, strict=True):
        if dur <= 0:
            continue  # zero-length segments (duty 0 or 1) carry no time
        if levels and levels[-1] == util:
            t += dur  # merge equal neighbours: fewer segments, same trace
            continue
        offsets.append(t)
        levels.append(util)
        t += dur
    if not offsets:
        raise ConfigError("workload has zero total duration")
    return Profile(offsets, levels, t, phase_ns)


def build_profile(workload: Workload, seed: int, gpu_index: int) -> Profile:
    """Compile a workload into the periodic :class:`Profile` of one GPU."""
    if isinstance(workload, IdleWorkload):
        return Profile([0], [0.0], _NS_PER_S, 0)
    if isinstance(workload, ConstantWorkload):
        return Profile([0], [float(workload.util)], _NS_PER_S, 0)
    if isinstance(workload, SquareWorkload):
        period = _s_to_ns(workload.period_s)
        high = min(max(_s_to_ns(workload.period_s * workload.duty), 0), period)
        return _from_segments(
            [high, period - high], [workload.high, workload.low], _s_to_ns(workload.phase_s)
        )
    if isinstance(workload, TraceWorkload):
        return _from_segments(
            [_s_to_ns(d) for d, _ in workload.segments],
            [float(u) for _, u in workload.segments],
            _s_to_ns(workload.phase_s),
        )
    rng = random.Random(stable_hash(seed, gpu_index, "random-workload"))
    lo_us = max(1, round(workload.seg_min_s * 1e6))
    hi_us = max(lo_us, round(workload.seg_max_s * 1e6))
    repeat = _s_to_ns(workload.repeat_s)
    durations: list[int] = []
    utils: list[float] = []
    t = 0
    while t < repeat:
        dur = min(rng.randint(lo_us, hi_us) * 1000, repeat - t)
        durations.append(dur)
        utils.append(float(rng.choice(workload.levels)))
        t += dur
    logger.debug("gpu %d: random workload with %d segments per repetition", gpu_index, len(utils))
    return _from_segments(durations, utils, _s_to_ns(workload.phase_s))
