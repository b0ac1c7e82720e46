"""Measurement windows on the time axis: families, lanes of the strip, innermost shading.

Names that differ only by a trailing number form one family (one colour, one legend entry,
:func:`_families`); :func:`_assign_lanes` lays windows out in lanes so nested and overlapping
ones stay apart, and :func:`_innermost` gives the shortest window covering each instant.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


#: Window names in one family share a colour and a legend entry.
_NUMBERED = re.compile(r"^(.*?\D)[-_.:#/ ]?\d+$")
#: Distinct names with one stem before they are grouped into a family.
_FAMILY_MIN = 3
#: Legend entries for windows before the rest are drawn grey as "other windows".
_MAX_FAMILIES = 10
#: Colours of window families (matplotlib's qualitative "Set2", then "Dark2").
_WINDOW_COLOURS = (
    "#66c2a5",
    "#fc8d62",
    "#8da0cb",
    "#e78ac3",
    "#a6d854",
    "#ffd92f",
    "#e5c494",
    "#1b9e77",
    "#d95f02",
    "#7570b3",
)
_OTHER_COLOUR = "#b3b3b3"


@dataclass
class _Span:
    name: str
    family: str
    start_s: float
    end_s: float
    unclosed: bool
    lane: int = 0


def _families(names: Sequence[str]) -> dict[str, str]:
    """Map each window name to its family: names that differ by a trailing number share one."""
    stems: dict[str, set[str]] = {}
    for name in names:
        m = _NUMBERED.match(name)
        if m:
            stems.setdefault(m.group(1).rstrip("-_.:#/ "), set()).add(name)
    out = {name: name for name in names}
    for stem, members in stems.items():
        if len(members) >= _FAMILY_MIN and stem not in out:
            for name in members:
                out[name] = f"{stem}-*"
    return out


class _Row:
    """Non-overlapping intervals of one lane of the window strip, sorted by start."""

    __slots__ = ("ends", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def fits(self, a: float, b: float) -> bool:
        i = bisect.bisect_right(self.starts, a)
        if i > 0 and self.ends[i - 1] > a:
            return False
        return i == len(self.starts) or self.starts[i] >= b

    def add(self, a: float, b: float) -> None:
        i = bisect.bisect_right(self.starts, a)
        self.starts.insert(i, a)
        self.ends.insert(i, b)


def _assign_lanes(by_family: dict[str, list[_Span]]) -> int:
    """Lay windows out in lanes, one block of lanes per family; returns the number of lanes.

    Within a family, windows go greedily to the first of its own sub-lanes free at their start
    (one sub-lane unless windows of one name overlap). Families are placed longest (median
    duration) first, each block at the lowest lanes where none of its windows overlaps a window
    already there: containers end up above what they contain, and every window of a family
    stays in the same row rather than being scattered into gaps.
    """
    rows: list[_Row] = []

    def median_len(spans: list[_Span]) -> float:
        lengths = sorted(s.end_s - s.start_s for s in spans)
        return lengths[len(lengths) // 2]

    families = sorted(
        by_family, key=lambda f: (-median_len(by_family[f]), min(s.start_s for s in by_family[f]))
    )
    for fam in families:
        sub: list[list[_Span]] = []
        sub_ends: list[float] = []
        for span in sorted(by_family[fam], key=lambda s: (s.start_s, s.start_s - s.end_s)):
            for j, end in enumerate(sub_ends):
                if end <= span.start_s:
                    sub[j].append(span)
                    sub_ends[j] = span.end_s
                    break
            else:
                sub.append([span])
                sub_ends.append(span.end_s)
        base = 0
        while not all(
            base + j >= len(rows) or all(rows[base + j].fits(s.start_s, s.end_s) for s in group)
            for j, group in enumerate(sub)
        ):
            base += 1
        for j, group in enumerate(sub):
            while base + j >= len(rows):
                rows.append(_Row())
            for span in group:
                span.lane = base + j
                rows[base + j].add(span.start_s, span.end_s)
    return len(rows)


def _innermost(spans: Sequence[_Span]) -> list[tuple[float, float, str]]:
    """Partition the windowed time into ``(start, end, family)`` of the shortest covering window.

    Shading only the innermost window at each instant keeps nested and overlapping windows from
    blending into an unreadable mix of colours (the strip shows every window); adjacent pieces
    of one family are merged. A sweep over the window edges with a heap keyed by duration.
    """
    edges = sorted({s.start_s for s in spans} | {s.end_s for s in spans})
    by_start = sorted(range(len(spans)), key=lambda i: spans[i].start_s)
    active: list[tuple[float, int]] = []
    out: list[tuple[float, float, str]] = []
    nxt = 0
    for a, b in itertools.pairwise(edges):
        while nxt < len(by_start) and spans[by_start[nxt]].start_s <= a:
            i = by_start[nxt]
            heapq.heappush(active, (spans[i].end_s - spans[i].start_s, i))
            nxt += 1
        while active and spans[active[0][1]].end_s <= a:
            heapq.heappop(active)
        if not active:
            continue
        family = spans[active[0][1]].family
        if out and out[-1][2] == family and out[-1][1] == a:
            out[-1] = (out[-1][0], b, family)
        else:
            out.append((a, b, family))
    return out
