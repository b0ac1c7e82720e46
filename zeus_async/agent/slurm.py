"""Slurm as a source of workload identity: which job (and step, user, partition, GPUs) a
process belongs to, and which jobs a prolog announced.

Two ways in, because each misses something:

* **From a process** (:meth:`SlurmSource.from_pid`): its cgroup, which the kernel keeps and
  the job cannot change, names the job and step; Slurm writes
  ``.../slurm[_<node>]/uid_<uid>/job_<id>/step_<step>/...`` (cgroup v1, one line per
  controller) or ``/system.slice/[<node>_]slurmstepd.scope/job_<id>/step_<step>/...``
  (cgroup v2). Its initial environment, when readable (the agent's own user's processes, or
  any as root), adds what the cgroup does not say: ``SLURM_JOB_USER``, ``SLURM_JOB_UID``,
  ``SLURM_JOB_PARTITION``, ``SLURM_JOB_NAME`` and the job's physical GPUs
  (``SLURM_STEP_GPUS``, else ``SLURM_JOB_GPUS``: Slurm's global GPU indices, which are the
  NVML indices where ``gres.conf`` lists ``/dev/nvidia<N>`` in order; else the GPU UUIDs in
  ``CUDA_VISIBLE_DEVICES``, whose plain indices are *not* used: under ``ConstrainDevices``
  Slurm renumbers them from 0 inside the job). Where the cgroup names a job, an environment
  whose ``SLURM_JOB_ID`` is not that job's is ignored (a process can set any variable; it
  cannot leave its cgroup). Where no cgroup names a Slurm job (a container's private cgroup
  namespace, a cluster without ``proctrack/cgroup``) the environment alone is taken.
* **Announced** (:meth:`SlurmSource.register` / :meth:`~SlurmSource.unregister`, what a
  prolog and epilog do): the job and its GPUs are known before any of its processes touches
  a GPU, and a GPU idle in a job is still the job's.
"""

from __future__ import annotations

import logging
import pwd
import re
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from ..errors import ConfigError
from . import _procfs

__all__ = [
    "ENVIRON_PREFIXES",
    "SlurmJob",
    "SlurmSource",
    "job_from_cgroup",
    "parse_gpu_list",
]

logger = logging.getLogger(__name__)

#: The environment variables a Slurm source reads (by prefix).
ENVIRON_PREFIXES = ("SLURM_", "CUDA_VISIBLE_DEVICES")

# cgroup v1: /slurm/uid_1001/job_4711/step_0/task_0 (also /slurm_<nodename>/... where several
# slurmd run on one host).
_V1 = re.compile(r"/slurm[^/]*/uid_(\d+)/job_(\d+)(?:/step_([^/]+))?")
# cgroup v2: /system.slice/slurmstepd.scope/job_4711/step_0/user/task_0 (also
# <nodename>_slurmstepd.scope).
_V2 = re.compile(r"slurmstepd\.scope/job_(\d+)(?:/step_([^/]+))?")
_JOB_ID = re.compile(r"\d+")
_RANGE = re.compile(r"(\d+)-(\d+)")

#: A GPU as a source names it: a physical (NVML) index, or a ``GPU-...`` UUID.
GpuRef = int | str


class SlurmJob(msgspec.Struct, frozen=True, kw_only=True):
    """What is known of one Slurm job, from one of its processes or from its prolog.

    Attributes:
        job_id: The job ID (digits).
        step: The step of the process it was read from (``"0"``, ``"batch"``, ``"extern"``);
            ``None`` for a registration.
        user: The job's user name.
        uid: The job's uid.
        partition: The job's partition.
        name: The job's name (``SLURM_JOB_NAME``).
        gpus: The job's (or step's) physical GPUs: NVML indices or ``GPU-...`` UUIDs.
    """

    job_id: str
    step: str | None = None
    user: str | None = None
    uid: int | None = None
    partition: str | None = None
    name: str | None = None
    gpus: tuple[GpuRef, ...] = ()


def job_from_cgroup(paths: Iterable[str]) -> tuple[str, str | None, int | None] | None:
    """``(job_id, step, uid)`` named by a process's cgroup paths (uid only in the v1 form),
    or ``None`` when none is a Slurm job's."""
    for path in paths:
        m = _V1.search(path)
        if m is not None:
            return m.group(2), m.group(3), int(m.group(1))
        m2 = _V2.search(path)
        if m2 is not None:
            return m2.group(1), m2.group(2), None
    return None


def parse_gpu_list(value: str | None, *, indices: bool = True) -> tuple[GpuRef, ...]:
    """The GPUs of a Slurm GPU variable (``"0,2"``, ``"0-3"``) or of a
    ``CUDA_VISIBLE_DEVICES`` (``indices=False``: only its ``GPU-...`` UUIDs count).

    MIG devices (``MIG-...``) and anything unreadable are left out: a workload's GPUs are
    whole GPUs, as the agent samples them.
    """
    if not value:
        return ()
    out: list[GpuRef] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.upper().startswith("GPU-"):
            out.append(entry)
        elif not indices:
            continue
        elif entry.isdigit():
            out.append(int(entry))
        elif (m := _RANGE.fullmatch(entry)) is not None:
            out.extend(range(int(m.group(1)), int(m.group(2)) + 1))
    return tuple(dict.fromkeys(out))


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _user_of(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _uid_of(user: str | None) -> int | None:
    if user is None:
        return None
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


class SlurmSource:
    """Slurm jobs, read from processes and announced by prologs (see the module docstring).

    Args:
        proc_root: Where ``/proc`` is (tests pass a fake tree).

    Thread-safe: a prolog's registration may come from another thread than the queries.
    """

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._registered: dict[str, SlurmJob] = {}
        #: Bumped by every registration change, so a reader can tell cheaply that it must
        #: look again.
        self.version = 0

    # -- announced jobs ---------------------------------------------------------------------

    def register(
        self,
        job_id: int | str,
        gpus: Iterable[GpuRef] = (),
        user: str | None = None,
        uid: int | None = None,
        partition: str | None = None,
        name: str | None = None,
    ) -> SlurmJob:
        """Announce a job (what a prolog knows: ``SLURM_JOB_ID``, ``SLURM_JOB_GPUS``,
        ``SLURM_JOB_USER``, ``SLURM_JOB_UID``, ``SLURM_JOB_PARTITION``). A user name without
        uid, or a uid without name, is completed from the password database. Registering a
        job again replaces what was said of it.

        Raises:
            ConfigError: The job ID is not a Slurm job ID (digits), or a GPU is neither an
                index nor a ``GPU-`` UUID.
        """
        job = str(job_id).strip()
        if _JOB_ID.fullmatch(job) is None:
            raise ConfigError(f"not a Slurm job ID: {job_id!r} (expected digits, e.g. 4711)")
        refs: list[GpuRef] = []
        for g in gpus:
            if isinstance(g, str):
                text = g.strip()
                if text.isdigit():
                    refs.append(int(text))
                elif text.upper().startswith("GPU-"):
                    refs.append(text)
                else:
                    raise ConfigError(f"job {job}: GPU {g!r} is neither an index nor a GPU UUID")
            elif isinstance(g, int) and not isinstance(g, bool):
                if g < 0:
                    raise ConfigError(f"job {job}: GPU index {g} is negative")
                refs.append(g)
            else:
                raise ConfigError(f"job {job}: GPU {g!r} is neither an index nor a GPU UUID")
        if uid is None:
            uid = _uid_of(user)
        if user is None:
            user = _user_of(uid)
        record = SlurmJob(
            job_id=job,
            user=user,
            uid=uid,
            partition=partition or None,
            name=name or None,
            gpus=tuple(dict.fromkeys(refs)),
        )
        with self._lock:
            self._registered[job] = record
            self.version += 1
        logger.debug("slurm job %s registered: %s", job, record)
        return record

    def unregister(self, job_id: int | str) -> bool:
        """Forget an announced job (its epilog ran); whether it was registered."""
        with self._lock:
            found = self._registered.pop(str(job_id).strip(), None) is not None
            if found:
                self.version += 1
        return found

    def registered(self) -> dict[str, SlurmJob]:
        """The announced jobs, by job ID (a copy)."""
        with self._lock:
            return dict(self._registered)

    # -- jobs read from processes ----------------------------------------------------------

    def from_pid(self, pid: int) -> SlurmJob | None:
        """The job ``pid`` belongs to, from its cgroup and (when readable) its environment;
        ``None`` when it is in no Slurm job or has exited."""
        environ = _procfs.read_environ(self.proc_root, pid)
        return self.from_process(
            _procfs.read_cgroup(self.proc_root, pid),
            None if environ is None else _procfs.parse_environ(environ, ENVIRON_PREFIXES),
        )

    @staticmethod
    def from_process(
        cgroup: Iterable[str] | None, environ: Mapping[str, str] | None
    ) -> SlurmJob | None:
        """The job named by a process's cgroup paths and environment, read already (see the
        module docstring for which wins)."""
        from_cgroup = job_from_cgroup(cgroup or ())
        env = environ or {}
        env_job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if env_job is not None and _JOB_ID.fullmatch(env_job) is None:
            env_job = None
        if from_cgroup is not None:
            job_id, step, uid = from_cgroup
            if env_job != job_id:  # another job's variables, or no job's: the cgroup's only
                if env_job is not None:
                    logger.debug(
                        "environment names job %s, cgroup job %s: environment ignored",
                        env_job,
                        job_id,
                    )
                env = {}
        elif env_job is not None:
            job_id, step, uid = env_job, None, None
        else:
            return None
        if step is None:
            step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or None
        if uid is None:
            uid = _int(env.get("SLURM_JOB_UID"))
        gpus = parse_gpu_list(env.get("SLURM_STEP_GPUS")) or parse_gpu_list(
            env.get("SLURM_JOB_GPUS")
        )
        if not gpus:
            gpus = parse_gpu_list(env.get("CUDA_VISIBLE_DEVICES"), indices=False)
        return SlurmJob(
            job_id=job_id,
            step=step,
            user=env.get("SLURM_JOB_USER") or None,
            uid=uid,
            partition=env.get("SLURM_JOB_PARTITION") or None,
            name=env.get("SLURM_JOB_NAME") or None,
            gpus=gpus,
        )
