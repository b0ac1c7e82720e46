"""Jobs of two users through a real Slurm on localhost (slurmctld, slurmd and munge from
Debian's packages, configured here; four simulated GPUs as gres, backed by character devices so
that Slurm tells the prolog, the epilog and the job which GPUs each holds) with one system
agent: each job's energy is its own (the sum of its GPUs' energy over its life, within 0.5 % of
the agent's recording), the epilog writes the figure beside the job's output (as the job's
user) and, with accounting (slurmdbd on a MariaDB of its own, when installed), into the job's
AdminComment in the database, and a job cancelled with scancel has its power limit restored.
Root only."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_async.devices.sim_config import SimConfig
from zeus_async.devices.sim_workload import RandomWorkload
from zeus_async.store.analysis import Recording
from zeus_async.testing import read_sim_node_state
from zeus_async.testing.procs import sim_env, start_node_agent
from zeus_async.testing.users import as_user, python_for

# Levels held 0.2-1.5 s: a job's start and end fall inside counter periods whose energy the
# ledger shares by time (docs/workloads.md), as on a real GPU between kernels.
CONFIG = SimConfig(num_gpus=4, seed=13, workload=RandomWorkload(seg_min_s=0.2, seg_max_s=1.5))
DEFAULT_W = CONFIG.power_limit_default_w
ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="runs Slurm's daemons and creates users: root"),
]


def _require_slurm() -> None:
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        reason = f"Slurm is not installed ({', '.join(missing)}; apt-get install slurm-wlm munge)"
        if os.environ.get("ZEUS_ASYNC_REQUIRE_SLURM") == "1":
            pytest.fail(reason + " and ZEUS_ASYNC_REQUIRE_SLURM=1 is set")
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_as_user = as_user


def _python_for(user: str) -> tuple[str, str]:
    found = python_for(user)
    if found is None:
        pytest.skip(f"no Python with this checkout's packages that user {user} can run")
    return found


def _state(pid: int) -> str:
    """A process's state letter (``Z``: exited, not reaped yet), ``""`` once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class Cluster:
    """A one-node Slurm cluster with a system agent, users and directories of its own."""

    def __init__(self) -> None:
        self.d = Path(tempfile.mkdtemp(prefix="zslurm-", dir="/tmp"))
        os.chmod(self.d, 0o755)
        tag = uuid.uuid4().hex[:6]
        self.group = f"zsl{tag}"
        subprocess.run(["groupadd", self.group], check=True)
        self.users = [f"zsl{r}{tag}" for r in ("a", "b")]
        for u in self.users:
            subprocess.run(
                ["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", self.group, u],
                check=True,
            )
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.d / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.socket = self.d / "run" / "agent.sock"
        self.state = self.d / "run" / "state"
        self.recording = self.d / "node.zarc"
        self.agent: subprocess.Popen[str] | None = None
        self.started: list[str] = []
        # Accounting (slurmdbd on a MariaDB of its own) where both are installed: the epilog
        # then writes AdminComment into the job's record in the database.
        self.with_accounting = all(shutil.which(c) for c in ("slurmdbd", "mariadbd", "sacct"))
        if not self.with_accounting and os.environ.get("ZEUS_ASYNC_REQUIRE_SLURM") == "1":
            pytest.fail(
                "slurmdbd and mariadb-server are not installed (ZEUS_ASYNC_REQUIRE_SLURM=1)"
            )
        self.mariadb: subprocess.Popen[bytes] | None = None

    def setup(self) -> None:
        d = self.d
        for sub in ("state", "spool", "dev"):
            (d / sub).mkdir()
        for i in range(4):  # character devices: Slurm then names the GPUs it gives a job
            os.mknod(d / "dev" / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        python, path = _python_for(self.users[0])
        zeus = d / "zeus-async"
        zeus.write_text(f'#!/bin/sh\nPYTHONPATH="{path}" exec "{python}" -m zeus_async "$@"\n')
        (d / "zeus.env").write_text(
            f"ZEUS_ASYNC_SOCKET={self.socket}\nZEUS_ASYNC_BIN={zeus}\nZEUS_ASYNC_TIMEOUT=30\n"
        )
        for name in ("prolog", "epilog"):
            script = d / f"{name}.sh"
            script.write_text(
                f"#!/bin/bash\nexport ZEUS_ASYNC_SLURM_ENV={d / 'zeus.env'}\n"
                f"exec {ROOT / 'deploy' / 'slurm' / f'{name}.sh'}\n"
            )
        for f in (zeus, d / "prolog.sh", d / "epilog.sh"):
            f.chmod(0o755)
        (d / "gres.conf").write_text(f"NodeName={self.host} Name=gpu File={d}/dev/nvidia[0-3]\n")
        self.name = f"z{uuid.uuid4().hex[:6]}"
        accounting = self._accounting() if self.with_accounting else ""
        self.conf.write_text(
            accounting + f"ClusterName={self.name}\nSlurmctldHost={self.host}\nSlurmUser=root\n"
            f"SlurmctldPort={_free_port()}\nSlurmdPort={_free_port()}\nAuthType=auth/munge\n"
            f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n"
            f"SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n"
            f"SlurmctldLogFile={d}/ctld.log\nSlurmdLogFile={d}/d.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "JobAcctGatherType=jobacct_gather/none\nSelectType=select/cons_tres\n"
            "SelectTypeParameters=CR_Core_Memory\nGresTypes=gpu\nReturnToService=2\n"
            f"Prolog={d}/prolog.sh\nEpilog={d}/epilog.sh\nPrologFlags=Alloc\n"
            f"NodeName={self.host} CPUs=2 RealMemory=2000 Gres=gpu:4 State=UNKNOWN\n"
            f"PartitionName=main Nodes={self.host} Default=YES MaxTime=INFINITE State=UP\n"
        )
        self._munge()
        if self.with_accounting:
            subprocess.run(["slurmdbd"], env=self.env, check=True)
            self.started.append("slurmdbd")
            deadline = time.monotonic() + 30
            while self._run("sacctmgr", "-i", "add", "cluster", self.name, check=False) == "":
                assert time.monotonic() < deadline, (d / "dbd.log").read_text()[-2000:]
                time.sleep(0.5)
        with open(d / "agent.log", "w") as log:
            self.agent = start_node_agent(
                sim_env(CONFIG),
                "--system",
                "--socket",
                str(self.socket),
                "--group",
                self.group,
                "--record",
                str(self.recording),
                stderr=log,
            )
        os.environ["ZEUS_ASYNC_DIR"] = str(self.state)  # where the simulated node's state is
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], env=self.env, check=True)
            self.started.append(daemon)
        deadline = time.monotonic() + 30
        while "idle" not in self._run("sinfo", "-h", "-o", "%T"):
            if time.monotonic() > deadline:
                raise AssertionError(
                    "the node did not come up: " + (d / "d.log").read_text()[-2000:]
                )
            self._run("scontrol", "update", f"nodename={self.host}", "state=resume", check=False)
            time.sleep(0.5)

    def _accounting(self) -> str:
        """A MariaDB of its own and slurmdbd's configuration; slurm.conf's accounting lines."""
        d = self.d
        db = d / "db"
        db.mkdir()
        subprocess.run(
            [
                "mariadb-install-db",
                "--user=root",
                f"--datadir={db}",
                "--auth-root-authentication-method=normal",
            ],
            check=True,
            capture_output=True,
        )
        port = _free_port()
        self.mariadb = subprocess.Popen(
            [
                "mariadbd",
                "--user=root",
                f"--datadir={db}",
                f"--socket={d}/my.sock",
                "--bind-address=127.0.0.1",
                f"--port={port}",
                f"--pid-file={d}/my.pid",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while subprocess.run(
            ["mariadb", "-uroot", f"--socket={d}/my.sock", "-e", "select 1"], capture_output=True
        ).returncode:
            assert time.monotonic() < deadline and self.mariadb.poll() is None, "no MariaDB"
            time.sleep(0.3)
        dbd = _free_port()
        conf = d / "slurmdbd.conf"
        conf.write_text(
            f"AuthType=auth/munge\nDbdHost=localhost\nDbdPort={dbd}\nSlurmUser=root\n"
            f"PidFile={d}/slurmdbd.pid\nLogFile={d}/dbd.log\n"
            "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={port}\nStorageUser=root\nStorageLoc=z_{self.name}\n"
        )
        conf.chmod(0o600)
        return (
            "AccountingStorageType=accounting_storage/slurmdbd\n"
            f"AccountingStorageHost=localhost\nAccountingStoragePort={dbd}\n"
        )

    def _munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return
        key = Path("/etc/munge/munge.key")
        for p in (Path("/etc/munge"), Path("/run/munge")):
            p.mkdir(parents=True, exist_ok=True)
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        for p in ("/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge"):
            if Path(p).exists():
                shutil.chown(p, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"], check=True)

    def _run(self, *argv: str, check: bool = True) -> str:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {out.stderr}")
        return out.stdout

    def submit(self, user: str, gpus: int, seconds: float) -> tuple[str, Path]:
        """A job of ``user`` holding ``gpus`` GPUs: caps its GPUs at 300 W through the system
        agent, says so, and runs ``seconds``; its id and output directory."""
        out = self.d / f"out-{user}"
        out.mkdir(exist_ok=True)
        pw = pwd.getpwnam(user)
        os.chown(out, pw.pw_uid, pw.pw_gid)
        private = out / "zdir"
        private.mkdir(mode=0o700, exist_ok=True)
        os.chown(private, pw.pw_uid, pw.pw_gid)
        python, path = _python_for(user)
        script = out / "job.sh"
        script.write_text(
            "#!/bin/bash\n"
            f'export PYTHONPATH="{path}" ZEUS_ASYNC_SYSTEM_AGENT="{self.socket}" '
            f'ZEUS_ASYNC_DIR="{private}" PYTHONUNBUFFERED=1\n'
            f'exec "{python}" -c "\n'
            "import os, time\n"
            "from zeus_async import Monitor\n"
            "m = Monitor()\n"
            "m.set_power_limit(300).result(30)\n"
            "print('capped', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
            f"time.sleep({seconds})\n"
            'm.close()\n"\n'
        )
        os.chown(script, pw.pw_uid, pw.pw_gid)
        script.chmod(0o755)
        res = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--gres=gpu:{gpus}",
                "--mem=100",
                "-o",
                f"{out}/%j.out",
                "-D",
                str(out),
                str(script),
            ],
            env=self.env,
            capture_output=True,
            text=True,
            preexec_fn=_as_user(user),
            cwd=out,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0], out

    def wait_output(self, job: str, out: Path, text: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        path = out / f"{job}.out"
        while time.monotonic() < deadline:
            if path.exists() and text in path.read_text():
                return path.read_text()
            time.sleep(0.2)
        raise AssertionError(
            f"job {job}: no {text!r} in its output: "
            f"{path.read_text() if path.exists() else '(none)'}\n{self._run('squeue')}"
            f"{(self.d / 'd.log').read_text()[-2000:]}"
        )

    def wait_gone(self, job: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while job in self._run("squeue", "-h", "-o", "%i"):
            assert time.monotonic() < deadline, self._run("squeue")
            time.sleep(0.2)

    def limits(self) -> list[float]:
        return [g.power_limit_w for g in read_sim_node_state(CONFIG)]

    def teardown(self) -> None:
        subprocess.run(
            ["scancel", "--full", "-u", self.users[0]], env=self.env, capture_output=True
        )
        subprocess.run(
            ["scancel", "--full", "-u", self.users[1]], env=self.env, capture_output=True
        )
        for daemon in ("slurmd", "slurmctld", "slurmdbd"):
            pid_file = self.d / f"{daemon}.pid"
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 15  # gone before its directory is removed
            while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            self.agent.communicate(timeout=30)
        if self.mariadb is not None:
            self.mariadb.terminate()
            self.mariadb.wait(timeout=30)
        for u in self.users:
            subprocess.run(["userdel", u], capture_output=True)
        subprocess.run(["groupdel", self.group], capture_output=True)
        os.environ.pop("ZEUS_ASYNC_DIR", None)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    _require_slurm()
    c = Cluster()
    try:
        c.setup()
        yield c
    finally:
        c.teardown()
        shutil.rmtree(c.d, ignore_errors=True)


def test_two_users_jobs_get_their_energy_and_a_cancelled_job_is_restored(
    cluster: Cluster,
) -> None:
    a_user, b_user = cluster.users
    job_a, out_a = cluster.submit(a_user, 2, 8.0)
    job_b, out_b = cluster.submit(b_user, 1, 300.0)
    gpus_a = [int(g) for g in cluster.wait_output(job_a, out_a, "capped").split()[-1].split(",")]
    gpus_b = [int(g) for g in cluster.wait_output(job_b, out_b, "capped").split()[-1].split(",")]
    assert len(gpus_a) == 2 and len(gpus_b) == 1 and not set(gpus_a) & set(gpus_b)
    limits = cluster.limits()
    assert [limits[g] for g in gpus_a + gpus_b] == [300.0] * 3, limits
    cluster.wait_gone(job_a)  # ends by itself
    time.sleep(2.0)
    cluster._run("scancel", job_b)
    cluster.wait_gone(job_b)
    deadline = time.monotonic() + 20
    while cluster.limits() != [DEFAULT_W] * 4:
        assert time.monotonic() < deadline, cluster.limits()
        time.sleep(0.1)
    reports = {}
    for job, out, user in ((job_a, out_a, a_user), (job_b, out_b, b_user)):
        path = out / f"zeus-energy-{job}.json"
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline, (cluster.d / "d.log").read_text()[-3000:]
            time.sleep(0.2)
        assert path.stat().st_uid == pwd.getpwnam(user).pw_uid
        reports[job] = json.loads(path.read_text())
        # AdminComment: slurmctld refuses to update a finished job (the epilog runs after it
        # finished); the epilog writes it into the job's record in the accounting database.
        if cluster.with_accounting:
            total = reports[job]["energy_j"]
            deadline = time.monotonic() + 20
            while True:
                comment = cluster._run("sacct", "-n", "-X", "-j", job, "-o", "AdminComment%80")
                if f"zeus_energy_j={total}" in comment:
                    break
                assert time.monotonic() < deadline, (job, comment)
                time.sleep(0.5)
    # Stop the agent: its recording is complete. Each job's figure is its GPUs' energy over
    # its life, as the recording's own estimator has it.
    assert cluster.agent is not None
    cluster.agent.send_signal(signal.SIGTERM)
    cluster.agent.communicate(timeout=30)
    rec = Recording.load(cluster.recording)
    for job, gpus in ((job_a, gpus_a), (job_b, gpus_b)):
        r = reports[job]
        assert r["user"] in (a_user, b_user) and set(r["gpus"]) == {str(g) for g in gpus}
        recorded = sum(
            rec.energy(f"gpu:{g}", r["start_ns"], r["end_ns"]).energy_j or 0.0 for g in gpus
        )
        print(json.dumps({"job": job, "epilog_j": r["energy_j"], "recorded_j": recorded}))
        assert r["energy_j"] == pytest.approx(recorded, rel=0.005), (job, r, recorded)
    assert grp.getgrnam(cluster.group)
