"""A fake ``/proc`` tree, so the workload sources run unchanged on processes tests invent.

:class:`FakeProc` writes, per pid, the files the workload sources read, with the kernel's
formats: ``stat`` (the start time is field 22), ``status`` (the ``Uid:`` line), ``comm``,
``cgroup`` (``hierarchy:controllers:path`` lines) and ``environ`` (NUL-separated). A process
whose ``environ`` is left out reads as one whose environment is not readable (another user's
process). Pass the root to :class:`~zeus_async.agent.slurm.SlurmSource` or
:class:`~zeus_async.agent.workloads.WorkloadResolver` as ``proc_root``.

Cgroup lines as Slurm and the kubelet write them come from :meth:`FakeProc.slurm_v1`,
:meth:`FakeProc.slurm_v2` and :meth:`FakeProc.kubepods`.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["FakeProc"]


class FakeProc:
    """A ``/proc`` tree under ``root`` with the processes a test adds.

    Args:
        root: Directory to create the tree in (created if missing).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._ticks = itertools.count(1000, 7)

    def add(
        self,
        pid: int,
        *,
        uid: int = 1000,
        comm: str = "python",
        cgroup: Sequence[str] = ("0::/",),
        environ: Mapping[str, str] | None = None,
        start: int | None = None,
    ) -> int:
        """Create (or replace: a pid reused) process ``pid``; returns its start time in ticks
        (a new one each call unless ``start`` is given)."""
        d = self.root / str(pid)
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        start = next(self._ticks) if start is None else start
        rest = " ".join(["0"] * 30)
        (d / "stat").write_text(
            f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 {start} {rest}\n"
        )
        (d / "status").write_text(
            f"Name:\t{comm}\nState:\tS (sleeping)\nPid:\t{pid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
        )
        (d / "comm").write_text(comm + "\n")
        (d / "cgroup").write_text("".join(line + "\n" for line in cgroup))
        if environ is not None:
            (d / "environ").write_bytes(
                b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items())
            )
        return start

    def remove(self, pid: int) -> None:
        """Process ``pid`` exits (and is reaped)."""
        shutil.rmtree(self.root / str(pid), ignore_errors=True)

    @staticmethod
    def slurm_v1(uid: int, job: int | str, step: str = "0", task: int = 0) -> list[str]:
        """The cgroup lines of a Slurm task under cgroup v1 (one per controller)."""
        path = f"/slurm/uid_{uid}/job_{job}/step_{step}/task_{task}"
        return [
            "12:memory:" + path,
            "11:devices:" + path,
            "10:cpuset:" + path,
            "9:freezer:" + path,
            "1:name=systemd:/system.slice/slurmd.service",
        ]

    @staticmethod
    def slurm_v2(job: int | str, step: str = "0", task: int = 0) -> list[str]:
        """The cgroup line of a Slurm task under cgroup v2."""
        return [f"0::/system.slice/slurmstepd.scope/job_{job}/step_{step}/user/task_{task}"]

    @staticmethod
    def kubepods(pod_uid: str, container_id: str) -> list[str]:
        """The cgroup line of a container of a Kubernetes pod (cgroup v2, systemd driver)."""
        pod = pod_uid.replace("-", "_")
        return [
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{pod}.slice/cri-containerd-{container_id}.scope"
        ]
