"""Who may use a system agent, and who may change which GPU setting within which range.

A system agent (``zeus-async agent --system``) serves every user of the node, so it decides
what each may do; a per-user agent needs none of this (its socket is its user's alone). The
policy is a TOML file (default ``/etc/zeus-async/policy.toml``; ``deploy/policy.example.toml``
is a commented sample)::

    [read]                     # who may connect: read windows and samples
    all = false                # true: every user of the node
    users = ["alice"]          # user names (or uids)
    groups = ["zeus-async"]    # group names (or gids); default: the agent's --group

    [control]
    default = "allocated"      # no rule applies: the GPUs allocated to the job ("none": refuse)

    [[control.rule]]           # who may change which setting on which GPUs, within what range
    users = ["alice"]
    groups = ["ml"]            # (or all = true)
    gpus = [0, 1]              # default: every GPU
    settings = ["power_limit", "sm_clocks"]   # default: both
    min_power_w = 150          # default: the GPU's own range
    max_power_w = 300
    min_sm_mhz = 600
    max_sm_mhz = 1800

A rule *applies* to a request when it names the user (or one of the user's groups), the GPU
and the setting. A request is granted when an applying rule's range holds the value; applying
rules whose ranges do not hold it refuse it (an operator's range is a limit, not a hint). When
no rule applies, ``control.default`` decides: ``allocated`` grants the GPUs allocated to the
client's job — asked of a hook, ``allocated_gpus(uid, pid) -> set[int] | None`` (``None``:
unknown, refused) — and ``none`` refuses. Root is never refused: it could change the hardware
itself. Indices are the agent's, NVML's (not shifted by any ``CUDA_VISIBLE_DEVICES``).

:func:`allocated_from_environ` is the default hook: the GPUs that ``SLURM_STEP_GPUS``,
``SLURM_JOB_GPUS`` or ``CUDA_VISIBLE_DEVICES`` name in the client's *initial* environment
(``/proc/<pid>/environ``). A user can start a process with any environment, so on a node where
users run processes outside the scheduler's control, write control rules (or set
``default = "none"``) instead of relying on it.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

from ..errors import PolicyDeniedError, PolicyError
from .journal import Setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # pragma: no cover
        tomllib = None

__all__ = [
    "SYSTEM_POLICY",
    "AllocatedGpus",
    "ControlRule",
    "Policy",
    "Who",
    "allocated_from_environ",
    "load_policy",
    "who",
]

logger = logging.getLogger(__name__)

#: Where a system agent reads its policy by default.
SYSTEM_POLICY = Path("/etc/zeus-async/policy.toml")

#: ``allocated_gpus(uid, pid)``: the agent's indices of the GPUs allocated to the job of
#: process ``pid`` (of user ``uid``); ``None`` when that cannot be told.
AllocatedGpus = Callable[[int, int], "set[int] | None"]

_WHAT: dict[Setting, str] = {"power_limit": "power limit", "sm_clocks": "SM clocks"}
_UNIT: dict[Setting, str] = {"power_limit": "W", "sm_clocks": "MHz"}


class Who(NamedTuple):
    """A client's user, from the kernel's credentials of its connection."""

    uid: int
    user: str
    gids: frozenset[int]
    groups: frozenset[str]

    def __str__(self) -> str:
        return f"user {self.user}" if self.user != str(self.uid) else f"uid {self.uid}"


def who(uid: int, gid: int) -> Who:
    """The user ``uid`` (primary group ``gid``, the connection's) with every group the user
    database gives it (``os.getgrouplist``)."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
        gids = {gid}
    else:
        gids = {gid, *os.getgrouplist(user, gid)}
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            names.add(str(g))
    return Who(uid, user, frozenset(gids), frozenset(names))


class _Subjects(NamedTuple):
    """Users and groups (names, or numeric ids as strings), or everyone."""

    all: bool
    users: frozenset[str]
    groups: frozenset[str]

    def match(self, w: Who) -> bool:
        return (
            self.all
            or w.user in self.users
            or str(w.uid) in self.users
            or bool(self.groups & w.groups)
            or any(str(g) in self.groups for g in w.gids)
        )

    def describe(self) -> str:
        if self.all:
            return "every user"
        parts = [f"user {u}" for u in sorted(self.users)]
        parts += [f"group {g}" for g in sorted(self.groups)]
        return ", ".join(parts) or "nobody"


class ControlRule(NamedTuple):
    """One ``[[control.rule]]``: who may change which settings on which GPUs, within which
    ranges (``None``: the GPU's own bound)."""

    key: str
    subjects: _Subjects
    gpus: frozenset[int] | None
    settings: frozenset[Setting]
    power_w: tuple[float | None, float | None]
    sm_mhz: tuple[float | None, float | None]

    def applies(self, w: Who, gpu: int, setting: Setting) -> bool:
        return (
            setting in self.settings
            and (self.gpus is None or gpu in self.gpus)
            and self.subjects.match(w)
        )

    def bounds(self, setting: Setting) -> tuple[float | None, float | None]:
        return self.power_w if setting == "power_limit" else self.sm_mhz

    def admits(self, setting: Setting, value: float | None) -> bool:
        if value is None:  # a clock reset: back to the driver's default, always within
            return True
        lo, hi = self.bounds(setting)
        return (lo is None or value >= lo) and (hi is None or value <= hi)


class Policy(NamedTuple):
    """A parsed policy (see the module docstring); ``path`` names it in every refusal."""

    path: Path
    read: _Subjects
    rules: tuple[ControlRule, ...] = ()
    default: Literal["allocated", "none"] = "allocated"
    #: Whether the file existed (a missing default file means the defaults).
    loaded: bool = True

    @property
    def where(self) -> str:
        return str(self.path) if self.loaded else f"{self.path} (absent: the defaults apply)"

    def socket_group_only(self, group: str) -> bool:
        """Whether only members of ``group`` may read (the socket can then be 0660 to that
        group, so the kernel refuses everyone else before the agent hears of them)."""
        return not self.read.all and not self.read.users and self.read.groups == {group}

    def may_read(self, w: Who) -> bool:
        return w.uid == 0 or self.read.match(w)

    def check_read(self, w: Who) -> None:
        """Raises:
        PolicyDeniedError: ``w`` may not connect."""
        if not self.may_read(w):
            raise PolicyDeniedError(
                f"refused {w}: this system agent serves {self.read.describe()} "
                f"([read] of {self.where})"
            )

    def check_control(
        self,
        w: Who,
        pid: int,
        setting: Setting,
        gpus: Sequence[int],
        value: float | None,
        allocated: Callable[[], set[int] | None],
    ) -> None:
        """Refuse a change of ``setting`` to ``value`` (``None``: a clock reset) on ``gpus``
        (the agent's indices) asked by process ``pid`` of ``w``, unless every GPU is granted.

        ``allocated`` is called (once) only when no rule applies to a GPU.

        Raises:
            PolicyDeniedError: Which GPU, why, and the policy file.
        """
        if w.uid == 0:
            return
        job: set[int] | None = None
        asked = False
        what = _WHAT[setting]
        shown = "" if value is None else f" {value:g} {_UNIT[setting]}"
        for gpu in gpus:
            rules = [r for r in self.rules if r.applies(w, gpu, setting)]
            if rules:
                if any(r.admits(setting, value) for r in rules):
                    continue
                ranges = "; ".join(
                    f"{_show(r.bounds(setting), _UNIT[setting])} ({r.key})" for r in rules
                )
                raise PolicyDeniedError(
                    f"gpu:{gpu} {what}{shown}: outside what {self.where} lets {w} set there: "
                    f"{ranges}"
                )
            if self.default == "none":
                raise PolicyDeniedError(
                    f"gpu:{gpu} {what}: no rule of {self.where} lets {w} change it "
                    '([control] default = "none")'
                )
            if not asked:
                job, asked = allocated(), True
            if job is None:
                raise PolicyDeniedError(
                    f"gpu:{gpu} {what}: no rule of {self.where} lets {w} change it, and the "
                    f"GPUs allocated to the job of process {pid} are unknown (no "
                    "SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES in its environment); ask the "
                    "operator for a [[control.rule]]"
                )
            if gpu not in job:
                raise PolicyDeniedError(
                    f"gpu:{gpu} {what}: not allocated to the job of process {pid} (its GPUs: "
                    f"{sorted(job)}), and no rule of {self.where} lets {w} change it"
                )

    def power_range(self, w: Who, gpu: int) -> tuple[float | None, float | None]:
        """The power limits ``w`` may set on ``gpu`` by the rules (``None``: the GPU's own
        bound; both ``None`` when no rule applies and the default decides)."""
        if w.uid == 0:
            return None, None
        rules = [r for r in self.rules if r.applies(w, gpu, "power_limit")]
        if not rules:
            return None, None
        lows = [r.power_w[0] for r in rules]
        highs = [r.power_w[1] for r in rules]
        lo = None if any(x is None for x in lows) else min(x for x in lows if x is not None)
        hi = None if any(x is None for x in highs) else max(x for x in highs if x is not None)
        return lo, hi


def _show(bounds: tuple[float | None, float | None], unit: str) -> str:
    lo, hi = bounds
    left = "the GPU's minimum" if lo is None else f"{lo:g}"
    right = "the GPU's maximum" if hi is None else f"{hi:g}"
    return f"[{left}, {right}] {unit}"


# -- loading ------------------------------------------------------------------------------------

_READ_KEYS = {"all", "users", "groups"}
_CONTROL_KEYS = {"default", "rule"}
_RULE_KEYS = {
    "all",
    "users",
    "groups",
    "gpus",
    "settings",
    "min_power_w",
    "max_power_w",
    "min_sm_mhz",
    "max_sm_mhz",
}


class _Reader:
    """Typed access to the parsed TOML with one-line errors naming the file and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> PolicyError:
        return PolicyError(f"policy file {self.path}: {key}: {problem}")

    def table(self, value: object, key: str, known: set[str]) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a table, not {type(value).__name__}")
        unknown = sorted(set(value) - known)
        if unknown:
            raise self.fail(
                f"{key}.{unknown[0]}" if key else unknown[0],
                f"unknown key (known: {', '.join(sorted(known))})",
            )
        return value

    def flag(self, table: Mapping[str, Any], key: str, where: str) -> bool:
        value = table.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(f"{where}.{key}", f"must be true or false, not {value!r}")
        return value

    def names(self, table: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(
            (isinstance(v, str) and v) or (isinstance(v, int) and not isinstance(v, bool))
            for v in value
        ):
            raise self.fail(f"{where}.{key}", f"must be a list of names or ids, not {value!r}")
        return frozenset(str(v) for v in value)

    def number(self, table: Mapping[str, Any], key: str, where: str) -> float | None:
        value = table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise self.fail(f"{where}.{key}", f"must be a positive number, not {value!r}")
        return float(value)

    def bounds(
        self, table: Mapping[str, Any], low: str, high: str, where: str
    ) -> tuple[float | None, float | None]:
        lo, hi = self.number(table, low, where), self.number(table, high, where)
        if lo is not None and hi is not None and lo > hi:
            raise self.fail(f"{where}.{low}", f"{lo:g} is above {high} ({hi:g})")
        return lo, hi


def load_policy(path: str | os.PathLike[str] | None = None, *, group: str) -> Policy:
    """The policy in ``path`` (default :data:`SYSTEM_POLICY`; a missing default file means
    the defaults: members of ``group`` read, control of the GPUs allocated to one's job).

    Raises:
        PolicyError: The file given cannot be read, is not TOML, or holds an unknown key or a
            value of the wrong type (one line naming the file and the key).
    """
    where = Path(path) if path is not None else SYSTEM_POLICY
    defaults = _Subjects(False, frozenset(), frozenset({group}))
    try:
        data = where.read_bytes()
    except FileNotFoundError:
        if path is not None:
            raise PolicyError(f"policy file {where}: does not exist") from None
        return Policy(where, defaults, loaded=False)
    except OSError as exc:
        raise PolicyError(f"policy file {where}: cannot be read ({exc.strerror})") from None
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise PolicyError(f"policy file {where}: reading TOML on Python 3.10 needs tomli")
    try:
        doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(f"policy file {where}: not valid TOML ({exc})") from None
    r = _Reader(where)
    top = r.table(doc, "", {"read", "control"})
    read = defaults
    if "read" in top:
        t = r.table(top["read"], "read", _READ_KEYS)
        read = _Subjects(
            r.flag(t, "all", "read"), r.names(t, "users", "read"), r.names(t, "groups", "read")
        )
    control = r.table(top.get("control", {}), "control", _CONTROL_KEYS)
    default = control.get("default", "allocated")
    if default not in ("allocated", "none"):
        raise r.fail("control.default", f'must be "allocated" or "none", not {default!r}')
    raw_rules = control.get("rule", [])
    if not isinstance(raw_rules, list):
        raise r.fail("control.rule", "must be an array of tables ([[control.rule]])")
    rules = tuple(_rule(r, raw, f"control.rule[{i}]") for i, raw in enumerate(raw_rules, 1))
    return Policy(where, read, rules, default)


def _rule(r: _Reader, raw: object, key: str) -> ControlRule:
    t = r.table(raw, key, _RULE_KEYS)
    subjects = _Subjects(r.flag(t, "all", key), r.names(t, "users", key), r.names(t, "groups", key))
    if not (subjects.all or subjects.users or subjects.groups):
        raise r.fail(key, "names nobody: give users, groups or all = true")
    gpus: frozenset[int] | None = None
    if "gpus" in t:
        value = t["gpus"]
        if not isinstance(value, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value
        ):
            raise r.fail(f"{key}.gpus", f"must be a list of GPU indices, not {value!r}")
        gpus = frozenset(value)
    settings: frozenset[Setting] = frozenset(("power_limit", "sm_clocks"))
    if "settings" in t:
        value = t["settings"]
        if not isinstance(value, list) or not all(s in _WHAT for s in value):
            raise r.fail(
                f"{key}.settings", f'must list "power_limit" and/or "sm_clocks", not {value!r}'
            )
        settings = frozenset(value)
    return ControlRule(
        key,
        subjects,
        gpus,
        settings,
        r.bounds(t, "min_power_w", "max_power_w", key),
        r.bounds(t, "min_sm_mhz", "max_sm_mhz", key),
    )


# -- the default allocation hook ----------------------------------------------------------------


def _environ(pid: int) -> dict[str, str] | None:
    try:
        data = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


def allocated_from_environ(uuids: Sequence[str]) -> AllocatedGpus:
    """The default ``allocated_gpus`` hook of a node whose GPUs have ``uuids`` (NVML order):
    the GPUs named by ``SLURM_STEP_GPUS`` or ``SLURM_JOB_GPUS`` (Slurm's node-wide indices),
    else ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs), in the client process's initial
    environment; ``None`` when none is set or the process cannot be read."""
    table = list(uuids)

    def allocated(uid: int, pid: int) -> set[int] | None:
        env = _environ(pid)
        if env is None:
            return None
        for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
            value = env.get(name)
            if value is not None:
                try:
                    return {int(v) for v in value.split(",") if v.strip()}
                except ValueError:
                    logger.warning("process %d: %s=%r is not a list of indices", pid, name, value)
                    return None
        value = env.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
        from ..devices.nvml_visible import parse_cuda_visible_devices

        try:
            return set(parse_cuda_visible_devices(value, len(table), table))
        except ValueError as exc:
            logger.warning("process %d: CUDA_VISIBLE_DEVICES=%r: %s", pid, value, exc)
            return None

    return allocated
