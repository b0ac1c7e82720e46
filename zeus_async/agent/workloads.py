"""Who holds each GPU and each process: the workload identity of the node agent.

A measurement is only useful to a cluster when it says whose it is. A :class:`Workload` names
one job, pod container or user with a stable :attr:`~Workload.key` (``slurm:4711``,
``k8s:<namespace>/<pod>/<container>``, ``uid:1001``) that exporters and recordings can use as
a label; a :class:`WorkloadResolver` answers, from its sources, which workload holds a GPU
(:meth:`~WorkloadResolver.for_gpu`) and which one a process works for
(:meth:`~WorkloadResolver.for_pid`).

Sources, strongest first (a GPU claimed by several goes to the strongest, then to the one
that started last):

1. Slurm jobs announced by a prolog (:meth:`.slurm.SlurmSource.register`);
2. Kubernetes pods, from the kubelet's PodResources API (:class:`.kubernetes.KubernetesSource`,
   read by :meth:`~WorkloadResolver.refresh`);
3. a Slurm job read from one of its processes (its cgroup and environment, with the job's GPUs
   from ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``);
4. the GPUs a process was seen using (``for_pid(pid, gpus=...)``, from NVML's process list):
   a plain process's GPU goes to its user, ``uid:<uid>``.

A process in a Kubernetes pod (``kubepods`` in its cgroup) is matched to the pod container
that holds its GPUs (``NVIDIA_VISIBLE_DEVICES``, or those it was seen using); until one
matches (the pod list not read yet), or for good in a pod that holds no GPU, it counts as its
pod by the UID its cgroup names (``k8s-pod:<uid>``: the kubelet's PodResources list has no
UIDs, so such a pod has no name here), and moves to the named pod container when it matches.
A process in no job or pod is its user's: ``uid:<uid>``, with the user name from the password
database and the command from ``/proc/<pid>/comm``.

**The label set stays bounded.** A workload ends when no source holds it any more (a job
unregistered and none of its processes left, a pod gone from the kubelet's list and none of
its processes left); ``ended_ns`` is then set, and ``expire_s`` later it is forgotten. Keys
are per job, pod container or user, never per process, and the process cache holds at most
``max_pids`` entries (least recently asked for go first). So over any number of job starts
and ends, the workloads known are those live plus those ended within ``expire_s``
(``tests/agent/test_workloads.py``).

**Cheap to ask, cheap to refresh.** :meth:`~WorkloadResolver.for_pid` reads ``/proc`` once
per process (its first time), then answers from the cache; :meth:`~WorkloadResolver.for_gpu`
is a dictionary look-up. :meth:`~WorkloadResolver.refresh` (call it every few seconds, in a
worker thread: the kubelet call may block up to its timeout) calls the kubelet once, checks
each cached process is still the same process (its start time in ``/proc/<pid>/stat``: a pid
reused by another process since is resolved again), and ends and expires workloads
(``bench/agent/bench_workloads.py``). A pid reused between two refreshes keeps its old
workload until the next refresh.

**A process read in the middle of its exec.** For a moment after ``execve`` (long enough that
a parent's ``subprocess.Popen`` has returned) a process's new command name is set but its
environment reads empty: the kernel has not laid it out yet. A process whose environment reads
empty is therefore not settled: it is read again when next asked for, and at each refresh,
until its environment shows (a process started with no environment at all, ``env -i``, is read
each time it is asked for). Its cgroup, inherited at fork, is right at once, so a process of a
Slurm job with cgroup tracking is its job's from the start; one whose job only its environment
names counts as its user's until then.
"""

from __future__ import annotations

import logging
import pwd
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from ..clock import Clock, RealClock
from ..errors import ConfigError, WorkloadSourceError
from . import _procfs
from .kubernetes import KubernetesSource, PodGpus, gpu_ref
from .slurm import ENVIRON_PREFIXES, SlurmJob, SlurmSource

__all__ = ["UNKNOWN", "Workload", "WorkloadKind", "WorkloadResolver"]

logger = logging.getLogger(__name__)

WorkloadKind = Literal["slurm", "kubernetes", "process"]

#: A GPU as the resolver keys it: an NVML index, or a lower-case ``gpu-...`` UUID not in the
#: resolver's table.
_GpuKey = int | str

# Strength of a GPU claim (lower wins).
_REGISTERED, _POD, _JOB_ENV, _SEEN = 0, 1, 2, 3


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """One job, pod container or user, as a label for what it measures.

    Attributes:
        kind: ``"slurm"``, ``"kubernetes"`` or ``"process"`` (a process in no job or pod:
            its user).
        key: Stable and unique per workload: ``slurm:<job_id>``,
            ``k8s:<namespace>/<pod>/<container>``, ``uid:<uid>``.
        job_id: The Slurm job ID.
        step: The Slurm step of the process asked about (``for_pid``); ``None`` for a GPU.
        user: The user name, where known.
        uid: The uid, where known.
        partition: The Slurm partition.
        namespace: The pod's namespace.
        pod: The pod's name.
        container: The container's name.
        command: The process's command name (``for_pid``); for a Slurm job from ``for_gpu``,
            the job's name where known.
        started_ns: When the resolver learned of the workload (wall clock, ns).
        ended_ns: When it saw the workload end (wall clock, ns); ``None`` while it runs.
    """

    kind: WorkloadKind
    key: str
    job_id: str | None = None
    step: str | None = None
    user: str | None = None
    uid: int | None = None
    partition: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    command: str | None = None
    started_ns: int | None = None
    ended_ns: int | None = None


#: What :meth:`WorkloadResolver.for_pid` answers for a process that is gone before it could
#: be read (never cached, never in the label set).
UNKNOWN = Workload(kind="process", key="unknown")

_MERGED = ("job_id", "user", "uid", "partition", "namespace", "pod", "container", "command")
_ENVIRON = (*ENVIRON_PREFIXES, "NVIDIA_VISIBLE_DEVICES")


class _Pid:
    """One cached process: which workload it is, and what it says about GPUs."""

    __slots__ = (
        "command",
        "env_gpus",
        "key",
        "kube_gpus",
        "provisional",
        "seen_gpus",
        "start",
        "step",
        "uid",
    )

    def __init__(
        self,
        start: int,
        key: str,
        uid: int | None,
        command: str | None,
        step: str | None = None,
        env_gpus: tuple[_GpuKey, ...] = (),
        kube_gpus: tuple[_GpuKey, ...] | None = None,
    ) -> None:
        self.start = start
        self.key = key
        self.uid = uid
        self.command = command
        self.step = step
        # The job's GPUs as its environment says (a Slurm process).
        self.env_gpus = env_gpus
        # GPUs it was seen using (NVML).
        self.seen_gpus: set[_GpuKey] = set()
        # A process in a pod not matched to one yet: the GPUs its environment names.
        self.kube_gpus = kube_gpus
        # Its environment read empty (mid-execve, a zombie, ``env -i``): read again when
        # next asked for, and at each refresh.
        self.provisional = False


_POD_UID = re.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})"
)


def _pod_uid(cgroup: Iterable[str]) -> str | None:
    """The pod UID a process's cgroup names (``/kubepods/burstable/pod<uid>/...``, or the
    systemd driver's ``kubepods-burstable-pod<uid with _>.slice``), else ``None``."""
    for path in cgroup:
        if "kubepods" in path:
            m = _POD_UID.search(path)
            if m is not None:
                return m.group(1).replace("_", "-").lower()
    return None


class WorkloadResolver:
    """Which workload holds each GPU and each process (see the module docstring).

    Args:
        slurm: The Slurm source (jobs read from processes, jobs announced by prologs);
            ``None``: no Slurm jobs.
        kubernetes: The kubelet source, read by :meth:`refresh`; ``None``: no pods.
        gpu_uuids: The UUID of each NVML index, so a GPU named by UUID (the kubelet's
            device IDs) is the same GPU as its index.
        proc_root: Where ``/proc`` is; default: the Slurm source's, else ``/proc``.
        expire_s: How long an ended workload is still known (for a last export of its
            figures) before it is forgotten.
        max_pids: How many processes are cached at most.
        clock: Time source (tests pass a :class:`~zeus_async.clock.FakeClock`).

    Thread-safe: :meth:`refresh` may run in a worker thread while the event loop asks.
    """

    def __init__(
        self,
        *,
        slurm: SlurmSource | None = None,
        kubernetes: KubernetesSource | None = None,
        gpu_uuids: Sequence[str] = (),
        proc_root: Path | None = None,
        expire_s: float = 300.0,
        max_pids: int = 8192,
        clock: Clock | None = None,
    ) -> None:
        if not expire_s >= 0:
            raise ConfigError(f"expire_s must be >= 0, got {expire_s!r}")
        if max_pids < 1:
            raise ConfigError(f"max_pids must be >= 1, got {max_pids!r}")
        self.slurm = slurm
        self.kubernetes = kubernetes
        if proc_root is None:
            proc_root = slurm.proc_root if slurm is not None else Path("/proc")
        self.proc_root = proc_root
        self.expire_ns = round(expire_s * 1e9)
        self.max_pids = max_pids
        self.clock: Clock = clock if clock is not None else RealClock()
        self._uuids = {u.lower(): i for i, u in enumerate(gpu_uuids) if u}
        self._lock = threading.RLock()
        self._known: dict[str, Workload] = {}
        self._ended_at: dict[str, int] = {}  # key -> monotonic ns it ended
        self._pids: OrderedDict[int, _Pid] = OrderedDict()
        self._registered: dict[str, tuple[_GpuKey, ...]] = {}
        #: Jobs announced once and ended by their epilog since (a bounded memory).
        self._unregistered: OrderedDict[str, None] = OrderedDict()
        self._registered_version = -1
        self._pods: dict[str, tuple[_GpuKey, ...]] = {}
        self._gpu_map: dict[_GpuKey, str] | None = None
        self._users: dict[int, str | None] = {}
        #: The last error of the Kubernetes source (``None`` once it answers again).
        self.last_error: str | None = None

    # -- queries ----------------------------------------------------------------------------

    def for_gpu(self, gpu: int | str) -> Workload | None:
        """The workload holding ``gpu`` (an NVML index or a ``GPU-...`` UUID), ``None`` when
        none is known to."""
        key = self._gpu_key(gpu)
        with self._lock:
            self._sync_registered()
            if self._gpu_map is None:
                self._gpu_map = self._build_gpu_map()
            holder = self._gpu_map.get(key) if key is not None else None
            return None if holder is None else self._known.get(holder)

    def for_pid(self, pid: int, gpus: Iterable[int | str] = ()) -> Workload:
        """The workload process ``pid`` works for: its Slurm job, its pod container, else its
        user (``uid:<uid>``); :data:`UNKNOWN` when it is gone before it could be read.

        Args:
            pid: The process.
            gpus: GPUs it was seen using (NVML indices or UUIDs): a process of no job holds
                them for its user, and a process in a pod is matched to the pod by them.
        """
        seen = [k for k in (self._gpu_key(g) for g in gpus) if k is not None]
        with self._lock:
            self._sync_registered()
            entry = self._pids.get(pid)
            if entry is None or entry.provisional:
                entry = self._resolve(pid, entry)
                if entry is None:
                    return UNKNOWN
                self._pids[pid] = entry
                while len(self._pids) > self.max_pids:
                    self._pids.popitem(last=False)
                self._gpu_map = None
            self._pids.move_to_end(pid)
            if seen and not entry.seen_gpus.issuperset(seen):
                entry.seen_gpus.update(seen)
                if entry.kube_gpus is not None:
                    self._match_pod(entry)
                self._gpu_map = None
            return self._view(entry)

    def workloads(self) -> list[Workload]:
        """Every workload known: those running and those ended within ``expire_s`` (the
        label set)."""
        with self._lock:
            self._sync_registered()
            return list(self._known.values())

    # -- maintenance ------------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the kubelet, drop processes that exited (or whose pid another process now
        has), end workloads no source holds any more, and forget those ended more than
        ``expire_s`` ago. Never raises for a source's failure: it is logged (once per
        distinct message) and kept in :attr:`last_error`, and what was known stays."""
        pods: list[PodGpus] | None = None
        if self.kubernetes is not None:
            try:
                pods = self.kubernetes.list()
            except WorkloadSourceError as exc:
                if str(exc) != self.last_error:
                    logger.warning("%s", exc)
                self.last_error = str(exc)
            else:
                if self.last_error is not None:
                    logger.warning("kubelet pod-resources answers again")
                self.last_error = None
        # The processes are checked outside the lock (a read of /proc each: the bulk of the
        # cost), so queries from another thread do not wait for them.
        with self._lock:
            cached = [(pid, entry.start) for pid, entry in self._pids.items()]
        gone = {
            (pid, start)
            for pid, start in cached
            if _procfs.read_start_ticks(self.proc_root, pid) != start
        }
        with self._lock:
            self._sync_registered()
            if pods is not None:
                self._apply_pods(pods)
            for pid, entry in list(self._pids.items()):
                if (pid, entry.start) in gone:
                    del self._pids[pid]
                    self._gpu_map = None
                elif entry.provisional:
                    again = self._resolve(pid, entry)
                    if again is None:
                        del self._pids[pid]
                    else:
                        self._pids[pid] = again
                    self._gpu_map = None
            self._end_and_expire()

    # -- internals --------------------------------------------------------------------------

    def _gpu_key(self, gpu: int | str) -> _GpuKey | None:
        if isinstance(gpu, bool):
            return None
        if isinstance(gpu, int):
            return gpu if gpu >= 0 else None
        ref = gpu_ref(gpu)
        if isinstance(ref, str):
            low = ref.lower()
            return self._uuids.get(low, low)
        return ref

    def _user(self, uid: int | None) -> str | None:
        if uid is None:
            return None
        if uid not in self._users:
            if len(self._users) >= 4096:
                self._users.clear()
            try:
                self._users[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._users[uid] = None
        return self._users[uid]

    def _upsert(self, new: Workload) -> None:
        """Learn of a workload a source holds now, or complete what is known of it (the
        first word on each field stays); one that had ended is running again."""
        old = self._known.get(new.key)
        if old is None:
            self._known[new.key] = msgspec.structs.replace(
                new, started_ns=self.clock.wall_ns(), ended_ns=None
            )
            self._gpu_map = None
            return
        changes: dict[str, object] = {
            f: getattr(new, f)
            for f in _MERGED
            if getattr(old, f) is None and getattr(new, f) is not None
        }
        if old.ended_ns is not None:
            changes["ended_ns"] = None
            self._ended_at.pop(new.key, None)
            self._gpu_map = None
        if changes:
            self._known[new.key] = msgspec.structs.replace(old, **changes)

    def _sync_registered(self) -> None:
        slurm = self.slurm
        if slurm is None or slurm.version == self._registered_version:
            return
        self._registered_version = slurm.version
        jobs = slurm.registered()
        before = set(self._registered)
        self._registered = {}
        for job in jobs.values():
            key = f"slurm:{job.job_id}"
            current = self._known.get(key)
            record = self._job_workload(job)
            if current is None:
                self._upsert(record)
            else:  # a registration replaces what processes said
                said = {f: getattr(record, f) for f in _MERGED}
                self._known[key] = msgspec.structs.replace(
                    current, **{f: v for f, v in said.items() if v is not None}
                )
                self._upsert(record)  # back, if it had ended
            self._registered[key] = tuple(
                k for k in (self._gpu_key(g) for g in job.gpus) if k is not None
            )
            self._unregistered.pop(key, None)
        # A job its epilog ended holds no GPU any more, whatever its straggling processes'
        # environment says (they are still its, for their own figures).
        for key in before - set(self._registered):
            self._unregistered[key] = None
        while len(self._unregistered) > self.max_pids:
            self._unregistered.popitem(last=False)
        self._end_and_expire()
        self._gpu_map = None

    @staticmethod
    def _job_workload(job: SlurmJob) -> Workload:
        return Workload(
            kind="slurm",
            key=f"slurm:{job.job_id}",
            job_id=job.job_id,
            user=job.user,
            uid=job.uid,
            partition=job.partition,
            command=job.name,
        )

    def _resolve(self, pid: int, before: _Pid | None = None) -> _Pid | None:
        """Read ``pid`` from /proc; ``before``: what was read of it last (provisional)."""
        entry = self._read(pid)
        if entry is not None and before is not None and before.start == entry.start:
            entry.seen_gpus.update(before.seen_gpus)
            if entry.kube_gpus is not None and before.seen_gpus:
                self._match_pod(entry)
        return entry

    def _read(self, pid: int) -> _Pid | None:
        root = self.proc_root
        start = _procfs.read_start_ticks(root, pid)
        if start is None:
            return None
        cgroup = _procfs.read_cgroup(root, pid) or []
        raw = _procfs.read_environ(root, pid)
        environ = _procfs.parse_environ(raw, _ENVIRON) if raw else {}
        command = _procfs.read_comm(root, pid)
        uid = _procfs.read_uid(root, pid)
        entry = self._entry(start, cgroup, environ, command, uid)
        if entry is not None and raw == b"":
            entry.provisional = True
        return entry

    def _entry(
        self,
        start: int,
        cgroup: list[str],
        environ: dict[str, str],
        command: str | None,
        uid: int | None,
    ) -> _Pid | None:
        if self.slurm is not None:
            job = self.slurm.from_process(cgroup, environ)
            if job is not None:
                record = self._job_workload(job)
                if record.uid is None:
                    record = msgspec.structs.replace(record, uid=uid)
                if record.user is None:
                    record = msgspec.structs.replace(record, user=self._user(record.uid))
                self._upsert(record)
                gpus = tuple(k for k in (self._gpu_key(g) for g in job.gpus) if k is not None)
                return _Pid(start, record.key, record.uid, command, job.step, gpus)
        if uid is None:
            return None
        pod_uid = _pod_uid(cgroup)
        if pod_uid is not None:
            # A process of a pod: its pod (by the UID its cgroup names) until the kubelet's
            # list names the pod container holding its GPUs; a pod with no GPU stays so.
            key = f"k8s-pod:{pod_uid}"
            self._upsert(Workload(kind="kubernetes", key=key, uid=uid, user=self._user(uid)))
            entry = _Pid(start, key, uid, command)
        else:
            user_key = f"uid:{uid}"
            self._upsert(Workload(kind="process", key=user_key, uid=uid, user=self._user(uid)))
            entry = _Pid(start, user_key, uid, command)
        if any("kubepods" in path for path in cgroup):
            visible = environ.get("NVIDIA_VISIBLE_DEVICES", "")
            entry.kube_gpus = tuple(
                k
                for k in (self._gpu_key(v) for v in visible.split(",") if v.strip())
                if k is not None
            )
            self._match_pod(entry)
        return entry

    def _match_pod(self, entry: _Pid) -> None:
        """Move a process in a pod to the one pod container holding its GPUs, if one is."""
        assert entry.kube_gpus is not None
        gpus = set(entry.kube_gpus) | entry.seen_gpus
        holders = {key for key, held in self._pods.items() if gpus.intersection(held)}
        if len(holders) != 1:
            return  # none yet, or a GPU shared by several pods (time-slicing): its user's
        key = holders.pop()
        entry.key = key
        entry.kube_gpus = None
        self._upsert(
            Workload(kind="kubernetes", key=key, uid=entry.uid, user=self._user(entry.uid))
        )
        self._gpu_map = None

    def _apply_pods(self, pods: list[PodGpus]) -> None:
        listed: dict[str, tuple[_GpuKey, ...]] = {}
        for p in pods:
            key = f"k8s:{p.namespace}/{p.pod}/{p.container}"
            gpus = tuple(k for k in (self._gpu_key(g) for g in p.gpus) if k is not None)
            listed[key] = tuple(dict.fromkeys((*listed.get(key, ()), *gpus)))
            self._upsert(
                Workload(
                    kind="kubernetes",
                    key=key,
                    namespace=p.namespace,
                    pod=p.pod,
                    container=p.container,
                )
            )
        if listed != self._pods:
            self._pods = listed
            self._gpu_map = None
            for entry in self._pids.values():
                if entry.kube_gpus is not None:
                    self._match_pod(entry)

    def _end_and_expire(self) -> None:
        now = self.clock.monotonic_ns()
        held = {e.key for e in self._pids.values()}
        held.update(self._registered)
        held.update(self._pods)
        for key, w in list(self._known.items()):
            if key in held:
                if w.ended_ns is not None:  # back (a straggler, a pod listed again)
                    self._known[key] = msgspec.structs.replace(w, ended_ns=None)
                    del self._ended_at[key]
                    self._gpu_map = None
            elif w.ended_ns is None:
                self._known[key] = msgspec.structs.replace(w, ended_ns=self.clock.wall_ns())
                self._ended_at[key] = now
                self._gpu_map = None
            elif now - self._ended_at[key] > self.expire_ns:
                del self._known[key]
                del self._ended_at[key]

    def _build_gpu_map(self) -> dict[_GpuKey, str]:
        best: dict[_GpuKey, tuple[int, int, str]] = {}

        def claim(gpus: Iterable[_GpuKey], strength: int, key: str) -> None:
            w = self._known.get(key)
            if w is None or w.ended_ns is not None:
                return
            rank = (strength, -(w.started_ns or 0), key)
            for g in gpus:
                if g not in best or rank < best[g]:
                    best[g] = rank

        for key, gpus in self._registered.items():
            claim(gpus, _REGISTERED, key)
        for key, gpus in self._pods.items():
            claim(gpus, _POD, key)
        for entry in self._pids.values():
            if entry.key in self._unregistered:
                continue
            claim(entry.env_gpus, _JOB_ENV, entry.key)
            claim(entry.seen_gpus, _SEEN, entry.key)
        return {g: rank[2] for g, rank in best.items()}

    def _view(self, entry: _Pid) -> Workload:
        w = self._known.get(entry.key)
        if w is None:  # expired while a pid still named it (cannot happen: it is held)
            return UNKNOWN
        if w.step == entry.step and w.command == entry.command:
            return w
        return msgspec.structs.replace(w, step=entry.step, command=entry.command)
