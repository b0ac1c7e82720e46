"""The agent process: owns the devices, samples each once, serves local clients.

``python -m zeus_async.agent.server CONFIG_JSON`` (what :class:`~zeus_async.runtime.
SamplerProcess` starts) or ``zeus-async agent`` (a node agent run by an operator or by the
first rank of a job). It runs one :class:`~zeus_async.runtime.Runtime` with measurement
windows and answers clients on a ROUTER socket (:mod:`.protocol`):

* window edges are stamped by the client; the agent measures them on its histories and sends
  each result back to the client that opened the window;
* power-limit and clock changes go through the runtime's leases: journalled before they are
  applied, put back when the client releases them, says goodbye, or dies (its pid is watched);
* SIGINT, SIGTERM and SIGHUP stop the agent in order: every lease is restored first. A private
  agent runs in its own session, so a Ctrl-C in the terminal or a SIGTERM to the job's process
  group reaches only its owner, which then closes it; if the owner dies without doing so, the
  agent notices within ``_WATCH_S``, restores and exits;
* outputs (recording, window log) are isolated: a full disk or a hung file system ends that
  output with a fault event and a warning, never the sampling or the restores;
* a *system* agent (``zeus-async agent --system``, root) serves every user its policy lets in
  (:mod:`.policy`, :mod:`.system`): each connection's user is the kernel's (``SO_PEERCRED``,
  checked on every message, not only the hello), each change is checked against the policy
  before it takes a lease, and leases stay per connection, so no user can change, release or
  restore another's.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import msgspec
import zmq
import zmq.asyncio

from .._liveness import ProcessWatch
from .._paths import DIR_ENV_VAR, private_dir
from ..errors import ConfigError, LeaseConflictError, PolicyDeniedError, sole_exception
from ..events import DeviceInfo, Measurement
from ..runtime.runtime import Runtime
from ..store.window_log import window_log_consumer
from .journal import Setting, lock_held
from .leases import describe_holder
from .ledger import LEDGER_FILE, WorkloadLedger
from .policy import AllocatedGpus, Policy, Who, allocated_from_environ, load_policy, who
from .protocol import (
    AgentConfig,
    Bye,
    Control,
    Edge,
    Hello,
    JobReport,
    Reply,
    RequestEdges,
    error_reply_fields,
)
from .requests import NodeRequests
from .workloads import UNKNOWN, WorkloadResolver

__all__ = ["EXIT_AGENT_RUNNING", "NODE_LOCK", "NODE_SOCKET", "node_agent_running", "run_agent"]

logger = logging.getLogger(__name__)

#: How often client and owner processes are checked for life (seconds).
_WATCH_S = 0.2
#: Longest an epilog's ``job_end`` waits for the job's GPUs' counters to move (seconds).
_SETTLE_S = 1.0
#: Exit code of a node agent that found another node agent running.
EXIT_AGENT_RUNNING = 3
#: Names in the private directory: the node agent's socket and the lock it holds.
NODE_SOCKET = "agent.sock"
NODE_LOCK = "agent.lock"


def node_agent_running() -> bool:
    """Whether a node agent holds the node lock (cheap: one ``flock`` probe)."""
    return lock_held(private_dir() / NODE_LOCK)


@contextlib.contextmanager
def _node_lock() -> Iterator[bool]:
    fd = os.open(private_dir() / NODE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class Peer(NamedTuple):
    """The kernel's credentials of a connection's process (``SO_PEERCRED``)."""

    uid: int
    gid: int
    pid: int


def peer_credentials(frame: Any) -> Peer | None:
    """The credentials of the process at the other end of an ipc connection, from the kernel
    (``SO_PEERCRED``, which libzmq exposes as the property ``Peer-Address`` of every message
    frame: ``host:uid:gid:pid``); ``None`` on a transport without credentials (tcp)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return None
    parts = str(address).rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return Peer(int(parts[1]), int(parts[2]), int(parts[3]))
    except ValueError:
        return None


class _Client:
    """One connection: its own lease holder, whatever other connections its process has.

    Its pid is the kernel's (the connection's credentials), never the one its hello claims;
    it is dead when that process has exited, zombie or not (:class:`ProcessWatch`).
    """

    __slots__ = ("ident", "label", "measured", "name", "pid", "uid", "visible", "watch", "who")

    def __init__(
        self,
        ident: bytes,
        name: str,
        pid: int,
        serial: int,
        visible: list[int] | None,
        who: Who | None = None,
    ) -> None:
        self.ident = ident
        self.pid = pid
        self.name = name
        # A system agent's client: its user (the kernel's word), named in its lease holder.
        self.who = who
        self.uid = who.uid if who is not None else None
        # Unique per connection: two Monitors in one process are two lease holders.
        user = f"{who}, " if who is not None else ""
        self.label = f"{name} ({user}pid {pid}, client {serial})"
        self.watch = ProcessWatch(pid)
        # The client's GPU i is the agent's GPU visible[i] (None: the same indices).
        self.visible = visible
        # The agent's GPUs its windows measure (None: all): only its own, not every GPU of
        # the node, so a node's window work grows with its ranks' windows, not ranks x GPUs.
        self.measured: frozenset[int] | None = None

    def alive(self) -> bool:
        return self.watch.alive()

    def to_agent(self, gpus: list[int] | None) -> list[int] | None:
        if gpus is None:
            return None if self.visible is None else list(self.visible)
        if self.visible is None:
            return list(gpus)
        out = []
        for g in gpus:
            if not 0 <= g < len(self.visible):
                raise ConfigError(
                    f"GPU index {g} out of range: {len(self.visible)} GPU(s) visible to this "
                    "process (CUDA_VISIBLE_DEVICES applies)"
                )
            out.append(self.visible[g])
        return out

    def to_client(self, m: Measurement) -> Measurement:
        if self.visible is None:
            return m
        back = {agent: mine for mine, agent in enumerate(self.visible)}

        def keyed(by_key: dict[str, Any]) -> dict[str, Any]:
            return {
                (f"gpu:{back[int(k[4:])]}" if k.startswith("gpu:") else k): v
                for k, v in by_key.items()
                if not k.startswith("gpu:") or int(k[4:]) in back
            }

        return msgspec.structs.replace(
            m,
            gpu_energy_j={back[g]: e for g, e in m.gpu_energy_j.items() if g in back},
            methods=keyed(m.methods),
            error_j=keyed(m.error_j),
        )


class Agent:
    """One agent's state: its runtime, clients and windows (see the module docstring)."""

    def __init__(
        self,
        cfg: AgentConfig,
        rt: Runtime,
        router: Any,
        *,
        policy: Policy | None = None,
        allocated_gpus: AllocatedGpus | None = None,
    ) -> None:
        self.cfg = cfg
        self.rt = rt
        self.router = router
        self.private = cfg.owner_pid != 0
        #: A system agent's policy (``None``: not a system agent), and how it learns the GPUs
        #: allocated to a client's job where no rule applies.
        self.policy = policy
        if policy is not None and allocated_gpus is None:
            uuids = [d.describe().uuid for d in rt.devices if d.key.startswith("gpu:")]
            allocated_gpus = allocated_from_environ(uuids)
        self.allocated_gpus = allocated_gpus
        #: Energy per workload (a node or system agent with ``workloads``), else ``None``.
        self.ledger: WorkloadLedger | None = None
        self._forged = 0  # messages refused for credentials not the connection's (logged)
        self.clients: dict[bytes, _Client] = {}
        # Agent-side window id -> (client ident, client's window id, client's name).
        self.windows: dict[int, tuple[bytes, int, str]] = {}
        # (client ident, client's window id) -> the cuts its closing edge asked for.
        self.cuts: dict[tuple[bytes, int], list[int]] = {}
        self._ids = itertools.count(1)
        self._serials = itertools.count(1)
        self._leaving: dict[bytes, anyio.Event] = {}
        # The owner of a private agent: dead once it exited, zombie or not.
        self.owner = ProcessWatch(cfg.owner_pid) if self.private else None
        self.enc = msgspec.msgpack.Encoder()
        self.idle_since = anyio.current_time()
        self.stopping = anyio.Event()
        #: The signal that stopped the agent, if one did.
        self.signum: int | None = None
        tracker = rt.tracker
        board = tracker.board if tracker is not None else None
        #: The power board's file, which clients map for provisional window figures.
        self.board = str(board.path) if board is not None and board.path is not None else None
        #: The node's request attributor (:mod:`.requests`): made at the first request edges.
        self.requests = NodeRequests(cfg, rt, self.send, self.clients)

    def send(self, ident: bytes, reply: Reply) -> None:
        try:
            self.router.send_multipart([ident, self.enc.encode(reply)], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("a client is not reading replies; dropped one")
        except zmq.ZMQError as exc:
            logger.debug("reply not sent: %s", exc)

    def key(self, client: _Client, name: str) -> str:
        return name if self.private else f"{client.name}/{name}"

    def on_result(self, m: Measurement) -> None:
        entry = self.windows.pop(m.window_id, None)
        if entry is None:
            return
        ident, window_id, name = entry
        cuts = self.cuts.pop((ident, window_id), None)
        client = self.clients.get(ident)
        if client is None:
            return
        pieces: list[tuple[float, float]] = []
        tracker = self.rt.tracker
        if cuts and tracker is not None:
            try:
                points = [m.start_ns, *cuts, m.end_ns]
                pieces = tracker.energy_pieces(points, client.measured)
            except Exception:
                logger.exception("splitting window %r at its carbon cuts failed", name)
        m = client.to_client(msgspec.structs.replace(m, window_id=window_id, name=name))
        self.send(ident, Reply(kind="measurement", measurement=m, pieces=pieces))

    # -- clients ----------------------------------------------------------------------------

    def _identify(self, hello: Hello, peer: Peer | None) -> tuple[int, str, Who | None]:
        """The client's pid (the kernel's word), a name unique among the clients and (a
        system agent) its user.

        Raises:
            ConfigError: The hello claims another process's pid, comes from another user, or
                (a private agent) from a process other than its owner.
            PolicyDeniedError: (A system agent) the policy does not let this user in.
        """
        pid = hello.pid
        client: Who | None = None
        if self.policy is not None:
            if peer is None:
                raise ConfigError("a system agent serves local (ipc) clients only")
            client = who(peer.uid, peer.gid)
            self.policy.check_read(client)
        if peer is not None:
            uid, pid = peer.uid, peer.pid
            if uid != os.getuid() and os.getuid() != 0:
                raise ConfigError(
                    f"refused a client of uid {uid}: this agent serves uid {os.getuid()}"
                )
            if hello.pid != pid:
                raise ConfigError(
                    f"refused a hello that names pid {hello.pid} from process {pid}: a client "
                    "speaks only for itself"
                )
        if self.private and pid != self.cfg.owner_pid:
            raise ConfigError(
                f"refused process {pid}: this private agent serves process {self.cfg.owner_pid}"
            )
        name = hello.name or f"pid{pid}"
        taken = {c.name for c in self.clients.values()}
        if name in taken:
            name = next(f"{name}#{n}" for n in itertools.count(2) if f"{name}#{n}" not in taken)
        return pid, name, client

    def hello(self, ident: bytes, hello: Hello, peer: Peer | None = None) -> None:
        if ident in self.clients:
            raise ConfigError("this connection has said hello already")
        pid, name, user = self._identify(hello, peer)
        visible = None
        if not self.private:
            visible = self._visible_for(hello.cuda_visible)
        client = _Client(ident, name, pid, next(self._serials), visible, user)
        tracker = self.rt.tracker
        assert tracker is not None
        gpus = sorted(tracker.gpu_indices)
        devices = [d.describe() for d in self.rt.devices if d.key.startswith("gpu:")]
        if self.policy is not None and user is not None:
            devices = [self._within_policy(user, d) for d in devices]
        if visible is not None:
            gpus = list(range(len(visible)))
            by_key = {d.key: d for d in devices}
            devices = [
                msgspec.structs.replace(by_key[f"gpu:{a}"], key=f"gpu:{i}")
                for i, a in enumerate(visible)
                if f"gpu:{a}" in by_key
            ]
        if hello.gpus is not None:
            unknown = [g for g in hello.gpus if g not in gpus]
            if unknown:
                raise ConfigError(
                    f"GPU index(es) {unknown} out of range: {len(gpus)} GPU(s) visible to this "
                    "process (CUDA_VISIBLE_DEVICES applies)"
                )
            gpus = sorted(set(hello.gpus))
            devices = [d for d in devices if int(d.key[4:]) in gpus]
            client.measured = frozenset(client.to_agent(gpus) or [])
        self.clients[ident] = client
        self.requests.follow(client, hello.follow)
        endpoint = self.rt.publisher.endpoint if self.rt.publisher is not None else None
        self.send(
            ident,
            Reply(
                kind="ready",
                gpus=gpus,
                cpus=sorted(tracker.cpu_packages),
                backend=self.rt.backend,
                endpoint=endpoint,
                devices=devices,
                prometheus_port=self.rt.prometheus_port,
                agent_pid=os.getpid(),
                board=self.board,
                board_gpus=client.to_agent(gpus) or [],
                system=self.policy is not None,
            ),
        )
        logger.info("client %s attached", client.label)

    def _within_policy(self, user: Who, device: DeviceInfo) -> DeviceInfo:
        """``device`` with the power-limit range ``user`` may set by the policy's rules, so
        an optimizer profiles only limits it will be granted."""
        assert self.policy is not None
        lo, hi = self.policy.power_range(user, int(device.key[4:]))
        low, high = device.power_limit_min_w, device.power_limit_max_w
        if lo is not None:
            low = lo if low is None else max(low, lo)
        if hi is not None:
            high = hi if high is None else min(high, hi)
        return msgspec.structs.replace(device, power_limit_min_w=low, power_limit_max_w=high)

    def verify(self, ident: bytes, frame: Any) -> bool:
        """Whether a message on a known connection comes from that connection's process (a
        system agent checks every one: a client that took another's routing id must not act
        as it)."""
        client = self.clients.get(ident)
        if client is None or self.policy is None:
            return True
        peer = peer_credentials(frame)
        if peer is not None and peer.pid == client.pid and peer.uid == client.uid:
            return True
        self._forged += 1
        if self._forged <= 10:
            logger.warning(
                "ignored a message on the connection of %s from another process (%s)",
                client.label,
                peer,
            )
        return False

    def _visible_for(self, cuda_visible: str | None) -> list[int] | None:
        if cuda_visible is None:
            return None
        from ..devices.nvml_visible import parse_cuda_visible_devices

        devices = [d.describe() for d in self.rt.devices if d.key.startswith("gpu:")]
        uuids = [d.uuid for d in devices]
        return list(parse_cuda_visible_devices(cuda_visible, len(uuids), uuids))

    async def goodbye(self, ident: bytes, *, dead: bool = False) -> None:
        """Forget a client: its windows finalized, its leases restored and released. A second
        call while the first runs waits for it (the watch and a control may both find the
        same client dead)."""
        leaving = self._leaving.get(ident)
        if leaving is not None:
            await leaving.wait()
            return
        if ident not in self.clients:
            return
        self._leaving[ident] = anyio.Event()
        try:
            await self._goodbye(ident, dead)
        finally:
            self._leaving.pop(ident).set()

    async def _goodbye(self, ident: bytes, dead: bool) -> None:
        client = self.clients[ident]
        tracker = self.rt.tracker
        assert tracker is not None
        prefix = "" if self.private else f"{client.name}/"
        for name in tracker.open_windows:
            if name.startswith(prefix):
                with contextlib.suppress(ValueError):
                    tracker.close(name, cancel=True)
        if not dead:
            # Windows it closed get their exact figures first (the data that completes them
            # comes within finalize_timeout_s), then whatever is left is measured as it is.
            with anyio.move_on_after(self.cfg.finalize_timeout_s + 0.05):
                while any(owner == ident for owner, _, _ in self.windows.values()):
                    await anyio.sleep(0.005)
        for agent_id, (owner, _, _) in list(self.windows.items()):
            if owner == ident:
                tracker.finalize(agent_id)  # resolves through on_result while still known
        released = await self.rt.release(client.label, source=f"restore: {client.label} left")
        if dead and released:
            logger.warning(
                "client %s died; restored %d setting(s) it had changed", client.label, len(released)
            )
        self.requests.left(client)
        del self.clients[ident]
        client.watch.close()
        if not dead:
            self.send(ident, Reply(kind="bye"))
        if not self.clients:
            self.idle_since = anyio.current_time()
        logger.info("client %s %s", client.label, "died" if dead else "left")

    async def control(self, ident: bytes, msg: Control) -> None:
        client = self.clients.get(ident)
        if client is None:
            return
        if msg.op in ("job_start", "job_end", "jobs"):
            try:
                jobs = await self._jobs(client, msg)
            except Exception as exc:
                self.send(ident, Reply(kind="control", seq=msg.seq, **error_reply_fields(exc)))  # type: ignore[arg-type]
            else:
                self.send(ident, Reply(kind="control", seq=msg.seq, jobs=jobs))
            return
        if msg.op == "requests":
            totals = self.requests.totals()
            self.send(ident, Reply(kind="control", seq=msg.seq, requests_totals=totals))
            return
        try:
            gpus = client.to_agent(msg.gpus)
            if msg.op in ("set_power_limit", "set_sm_clocks"):
                await self._permit(client, msg, gpus)
                # A client that died since the last watch (a job restarted right after a
                # SIGKILL) gives its leases back first, rather than block this change.
                await self.reap_dead_clients()
                if msg.op == "set_sm_clocks" and msg.mhz is None:
                    self._check_reset(client, gpus)
            if msg.op == "set_power_limit":
                await self.rt.set_power_limit(
                    msg.watts, gpus, source=msg.source, holder=client.label, pid=client.pid
                )
            elif msg.op == "set_sm_clocks":
                await self.rt.set_sm_clocks(
                    msg.mhz, gpus, source=msg.source, holder=client.label, pid=client.pid
                )
            elif msg.op == "release":
                await self.rt.release(client.label, gpus, msg.setting, source=msg.source)
            elif msg.event is not None:
                await self.rt.publish(msg.event)
        except Exception as exc:
            self.send(ident, Reply(kind="control", seq=msg.seq, **error_reply_fields(exc)))  # type: ignore[arg-type]
        else:
            self.send(ident, Reply(kind="control", seq=msg.seq))

    async def _jobs(self, client: _Client, msg: Control) -> list[JobReport]:
        """``job_start``, ``job_end`` and ``jobs`` (see :class:`.protocol.Control`).

        Raises:
            ConfigError: The agent keeps no workloads, no job given, or a bad job.
            PolicyDeniedError: (a system agent) a job announced or ended by another user
                than root.
        """
        ledger = self.ledger
        if ledger is None or ledger.resolver.slurm is None:
            raise ConfigError("this agent keeps no energy per job (a private agent)")
        if msg.op == "jobs":
            return ledger.reports()
        if msg.job is None:
            raise ConfigError(f"{msg.op} needs a job")
        if client.who is not None and client.who.uid != 0:
            raise PolicyDeniedError(
                f"only root may {msg.op.replace('_', ' ')} (a Slurm prolog or epilog); "
                f"{client.who} may not"
            )
        slurm = ledger.resolver.slurm
        if msg.op == "job_start":
            job = msg.job
            slurm.register(job.job_id, job.gpus, job.user, job.uid, job.partition, job.name)
            await ledger.tick(self.rt.publish)  # announced at once
            return []
        key = f"slurm:{msg.job.job_id.strip()}"
        gpus = [g for r in ledger.reports() if r.key == key for g in r.gpus]
        if not slurm.unregister(msg.job.job_id):
            raise ConfigError(f"job {msg.job.job_id} was not started on this agent")
        # The energy up to now is credited once each of its GPUs' counters has moved since
        # (at most a counter period, ~0.1 s): that step is shared with the job by time.
        ended = self.rt.clock.wall_ns()
        with anyio.move_on_after(_SETTLE_S):
            while not ledger.settled(gpus, ended):
                await anyio.sleep(0.01)
        reports = [r for r in ledger.reports() if r.key == key]
        for r in reports:
            r.ended_ns = r.ended_ns or ended
        await ledger.tick(self.rt.publish)  # its end announced at once
        return reports

    async def _permit(self, client: _Client, msg: Control, gpus: list[int] | None) -> None:
        """(A system agent) refuse a change the policy does not grant this client's user.

        Raises:
            PolicyDeniedError: Which GPU and why, naming the policy file.
        """
        if self.policy is None or client.who is None or self.allocated_gpus is None:
            return
        user = client.who
        if user.uid == 0:
            return
        setting: Setting = "power_limit" if msg.op == "set_power_limit" else "sm_clocks"
        value = msg.watts if setting == "power_limit" else msg.mhz
        targets = gpus if gpus is not None else sorted(self._gpu_uuids())
        job: set[int] | None = None
        if self.policy.default == "allocated" and any(
            not any(r.applies(user, g, setting) for r in self.policy.rules) for g in targets
        ):
            # The hook may read /proc or ask a scheduler: off the event loop.
            job = await anyio.to_thread.run_sync(self.allocated_gpus, user.uid, client.pid)
        self.policy.check_control(user, client.pid, setting, targets, value, lambda: job)

    def _gpu_uuids(self) -> dict[int, str]:
        """The agent's GPU index -> UUID."""
        out = {}
        for d in self.rt.devices:
            info = d.describe()
            if info.key.startswith("gpu:"):
                out[int(info.key[4:])] = info.uuid
        return out

    def _check_reset(self, client: _Client, gpus: list[int] | None) -> None:
        """A clock reset is a change too: refused while another client holds the clocks.

        Raises:
            LeaseConflictError: Naming the holder.
        """
        leases = self.rt.leases
        if leases is None:
            return
        uuids = self._gpu_uuids()
        wanted = [uuids[g] for g in (gpus if gpus is not None else sorted(uuids)) if g in uuids]
        for entry in leases.held_by(None, wanted, ["sm_clocks"]):
            if entry.holder != client.label:
                raise LeaseConflictError(
                    f"gpu:{entry.gpu}'s locked SM clocks are held by {describe_holder(entry)}; "
                    "it must release them (or exit) before another client resets them"
                )

    def edge(self, ident: bytes, msg: Edge) -> None:
        client = self.clients.get(ident)
        tracker = self.rt.tracker
        if client is None or tracker is None:
            return
        key = self.key(client, msg.name)
        try:
            if msg.open:
                agent_id = next(self._ids)
                tracker.open(
                    key,
                    restart=msg.restart,
                    t_ns=msg.t_ns,
                    window_id=agent_id,
                    gpus=client.measured,
                )
                self.windows[agent_id] = (ident, msg.id, msg.name)
            else:
                if msg.cuts and not msg.cancel:
                    # Before the close: the window may be finalized on the runtime's thread
                    # at once. Only increasing instants inside the window are kept.
                    self.cuts[(ident, msg.id)] = sorted(set(msg.cuts))
                result = tracker.close(key, cancel=msg.cancel, t_ns=msg.t_ns)
                if msg.cancel:
                    self.windows.pop(result.window_id, None)
        except ValueError as exc:  # the client keeps the books; this is a bug
            self.cuts.pop((ident, msg.id), None)
            logger.error("bad window edge from %s %r: %s", client.label, msg, exc)

    async def reap_dead_clients(self) -> None:
        """Say goodbye for every client whose process has exited (zombie or not)."""
        for ident, client in list(self.clients.items()):
            if not client.alive():
                await self.goodbye(ident, dead=True)

    async def watch(self) -> None:
        """Notice dead clients (and a dead owner) and clean up after them."""
        while True:
            await anyio.sleep(_WATCH_S)
            if self.owner is not None and not self.owner.alive():
                logger.warning(
                    "owner process %d is gone; restoring and stopping", self.cfg.owner_pid
                )
                self.stopping.set()
                return
            await self.reap_dead_clients()
            idle = self.cfg.exit_when_idle_s
            if (
                idle is not None
                and not self.clients
                and anyio.current_time() - self.idle_since >= idle
            ):
                logger.info("no client for %.1f s; stopping", idle)
                self.stopping.set()
                return


async def _signals(agent: Agent) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as received:
        async for signum in received:
            logger.warning("signal %d: restoring hardware settings and stopping", signum)
            agent.signum = int(signum)
            agent.stopping.set()
            return


class _System(NamedTuple):
    """A system agent's policy, and who may open its socket and power board."""

    policy: Policy
    gid: int
    mode: int

    @property
    def board_mode(self) -> int:
        return 0o644 if self.mode == 0o666 and self.policy.read.all else 0o640


def _system(cfg: AgentConfig) -> _System | None:
    """A system agent's policy and socket group (``None``: not a system agent).

    Raises:
        PolicyError: The policy file cannot be used.
        ConfigError: The group does not exist.
    """
    if not cfg.system:
        return None
    from .system import group_id

    gid = group_id(cfg.system_group)
    policy = load_policy(cfg.policy, group=cfg.system_group)
    # Only the group reads: the kernel refuses everyone else at the socket already. Others
    # named by the policy need a socket anyone may open; the agent's check admits them alone.
    mode = 0o660 if policy.socket_group_only(cfg.system_group) else 0o666
    return _System(policy, gid, mode)


def _seed_routing_ids() -> None:
    """libzmq numbers a ROUTER's connections from ``rand()``, never seeded: the same numbers in
    every process. A client that names itself (``ZMQ_ROUTING_ID``) with the number the next
    client will get makes libzmq abort on an assertion when that client connects. Seeded from
    the OS, the numbers cannot be guessed (a system agent's clients are other users)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


async def run_agent(
    cfg: AgentConfig,
    *,
    ready_line: bool = False,
    allocated_gpus: AllocatedGpus | None = None,
) -> int | None:
    """Run an agent until it is told to stop (see the module docstring); the signal that
    stopped it, if one did.

    ``allocated_gpus(uid, pid)``: (a system agent) the GPUs allocated to a client's job,
    asked where no policy rule applies (default: :func:`.policy.allocated_from_environ`).
    """
    from ..devices.sim import SimConfig

    system = _system(cfg)
    if system is not None:
        _seed_routing_ids()
    actx = zmq.asyncio.Context()
    router = actx.socket(zmq.ROUTER)
    # A client that connects with the routing id of another must not take its connection over
    # (and act as it): refused on a system agent, whose clients are other users.
    router.setsockopt(zmq.ROUTER_HANDOVER, 0 if system is not None else 1)
    dec = msgspec.msgpack.Decoder(Hello | Edge | Bye | Control | RequestEdges)
    sim_config: Any = (
        msgspec.json.decode(cfg.sim_config, type=SimConfig) if cfg.sim_config else None
    )
    processes = cfg.processes
    if processes is not None:
        # The owner's process tree, less this agent.
        processes = msgspec.structs.replace(processes, exclude=(*processes.exclude, os.getpid()))
    old_umask = os.umask(0o077)  # the socket file: owner only
    try:
        router.bind(cfg.endpoint)
    finally:
        os.umask(old_umask)
    try:
        if system is not None:  # then the group's (or everyone's: the agent checks each one)
            from .system import publish_file

            publish_file(_socket_path(cfg), system.gid, system.mode)
        return await _run_runtime(
            cfg, router, dec, sim_config, processes, ready_line, system, allocated_gpus
        )
    except Exception as exc:
        if cfg.owner_pid:
            await _tell_owner(router, dec, sole_exception(exc))
        raise
    finally:
        router.close(linger=500)
        actx.term()


async def _tell_owner(router: Any, dec: msgspec.msgpack.Decoder[Any], exc: BaseException) -> None:
    """A private agent that could not start answers its owner's hello with the error, typed."""
    with anyio.move_on_after(5):
        while True:
            ident, data = await router.recv_multipart()
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                if isinstance(dec.decode(data), Hello):
                    reply = Reply(kind="error", **error_reply_fields(exc))  # type: ignore[arg-type]
                    await router.send_multipart([ident, msgspec.msgpack.encode(reply)])
                    return


def _carbon(cfg: AgentConfig) -> Any:
    """A private agent's carbon configuration (its exporters' CO2e and cost series); a node
    agent keeps none: its clients each integrate their own (``Edge.cuts``)."""
    if cfg.carbon is None:
        return None
    if not cfg.owner_pid:
        logger.warning(
            "a node agent keeps no carbon configuration (its clients each have their own): "
            "the one given is ignored"
        )
        return None
    return cfg.carbon


def _publish_curve(cfg: AgentConfig) -> Any:
    if cfg.publish_curve_secret is None:
        return None
    from ..bus.curve import load_server_keys

    return load_server_keys(cfg.publish_curve_secret, allowed_clients_dir=cfg.publish_curve_allow)


async def _run_runtime(
    cfg: AgentConfig,
    router: Any,
    dec: msgspec.msgpack.Decoder[Any],
    sim_config: Any,
    processes: Any,
    ready_line: bool,
    system: _System | None = None,
    allocated_gpus: AllocatedGpus | None = None,
) -> int | None:
    # A system agent's board sits beside its socket (its users map it); others' in the
    # private directory.
    board_dir = _socket_path(cfg).parent if system is not None else private_dir()
    workloads = _AgentWorkloads(cfg) if cfg.workloads else None
    runtime = Runtime(
        backend=cfg.backend,
        gpus=cfg.gpus,
        cpus=cfg.cpus if cfg.cpus is not None else "auto",
        period_s=cfg.period_s,
        fields=cfg.fields,
        adaptive_reads=cfg.adaptive_reads,
        power_scope=cfg.power_scope,
        publish=cfg.publish,
        publish_curve=_publish_curve(cfg),
        sim_config=sim_config,
        windows=True,
        finalize_timeout_s=cfg.finalize_timeout_s,
        window_board=str(board_dir / f"board-{os.getpid()}-{os.urandom(4).hex()}"),
        record=cfg.record,
        overwrite=cfg.overwrite,
        processes=processes,
        # Each tracked process's samples name its job, pod container or user.
        process_workload=(
            workloads.process_key if workloads is not None and processes is not None else None
        ),
        meta=cfg.meta,
        prometheus_port=cfg.prometheus_port,
        prometheus_addr=cfg.prometheus_addr,
        prometheus_names=cfg.prometheus_names,
        otlp=cfg.otlp,
        otlp_interval_s=cfg.otlp_interval_s,
        host=cfg.host,
        carbon=_carbon(cfg),
    )
    if workloads is not None:
        workloads.runtime = runtime
    if True:
        async with runtime as rt:
            if cfg.log_file:
                rank = cfg.meta.get("rank")
                rt.start_consumer(
                    window_log_consumer(
                        cfg.log_file,
                        rank=None if rank is None else int(rank),
                        devices=[d.describe() for d in rt.devices],
                        workload=_own_workload(cfg.owner_pid or os.getpid()),
                    ),
                    isolate="window log",
                )
            ledger = (
                WorkloadLedger(
                    workloads.resolver, host=rt.host, state_path=private_dir() / LEDGER_FILE
                )
                if workloads is not None
                else None
            )
            if ledger is not None:
                rt.start_consumer(ledger.consume, isolate="workload ledger")
                if allocated_gpus is None and system is not None:
                    allocated_gpus = _allocated_by(ledger.resolver, rt)
            agent = Agent(
                cfg,
                rt,
                router,
                policy=system.policy if system is not None else None,
                allocated_gpus=allocated_gpus,
            )
            agent.ledger = ledger
            if system is not None and agent.board is not None:
                from .system import publish_file

                publish_file(Path(agent.board), system.gid, system.board_mode)
            tracker = rt.tracker
            assert tracker is not None
            tracker.on_result = agent.on_result
            if ready_line:
                metrics = rt.prometheus_port
                where = "" if metrics is None else f" (metrics on port {metrics})"
                print(f"agent ready: {cfg.endpoint}{where}", flush=True)  # noqa: T201
            async with anyio.create_task_group() as tg:
                tg.start_soon(_signals, agent)
                tg.start_soon(agent.watch)
                tg.start_soon(_serve, agent, dec)
                tg.start_soon(agent.requests.run)
                if ledger is not None:
                    tg.start_soon(ledger.run, rt.publish)
                await agent.stopping.wait()
                tg.cancel_scope.cancel()
            for ident in list(agent.clients):
                await agent.goodbye(ident)
            return agent.signum


class _AgentWorkloads:
    """The agent's workload resolver: who holds each GPU (Slurm always; the kubelet when
    ``k8s_socket`` is set) and which workload each tracked process works for. The ledger
    (energy per workload, kept in the agent's directory across restarts) is made on it.

    Made at its first use, from the GPUs of :attr:`runtime` (set before it is entered): the
    resolver needs their UUIDs, known once the runtime has opened its devices, and the
    runtime's process sampler asks :meth:`process_key` from its first period on, in its own
    thread, before ``async with`` hands the runtime to the agent (entering waits for the
    energy counters to move). The ledger, made in the ``async with`` body, takes the same
    resolver; whichever comes first makes it, under a lock.
    """

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.runtime: Runtime | None = None
        self._resolver: WorkloadResolver | None = None
        self._lock = threading.Lock()

    @property
    def resolver(self) -> WorkloadResolver:
        resolver = self._resolver
        if resolver is None:
            with self._lock:
                if self._resolver is None:
                    self._resolver = self._make()
                resolver = self._resolver
        return resolver

    def _make(self) -> WorkloadResolver:
        from .kubernetes import KubernetesSource
        from .slurm import SlurmSource

        assert self.runtime is not None, "the runtime is set before it is entered"
        gpus = sorted(
            (d.describe() for d in self.runtime.devices if d.key.startswith("gpu:")),
            key=lambda d: int(d.key.split(":")[1]),
        )
        return WorkloadResolver(
            slurm=SlurmSource(),
            kubernetes=KubernetesSource(self.cfg.k8s_socket) if self.cfg.k8s_socket else None,
            gpu_uuids=[d.uuid for d in gpus],
            expire_s=self.cfg.workload_expire_s,
        )

    def process_key(self, pid: int, gpus: Sequence[int]) -> str:
        """The key of the workload ``pid`` works for (``""`` when it is gone unread); the
        GPUs NVML listed it on make a process of no job hold them for its user."""
        workload = self.resolver.for_pid(pid, gpus)
        return "" if workload is UNKNOWN else workload.key


def _allocated_by(resolver: WorkloadResolver, rt: Runtime) -> AllocatedGpus:
    """The policy's allocated-GPUs hook from the workload resolver: the GPUs the client's job
    holds (announced by its prolog, or read from its cgroup and environment); for a process
    in no job, what its environment says (:func:`.policy.allocated_from_environ`)."""
    uuids = [d.describe().uuid for d in rt.devices if d.key.startswith("gpu:")]
    fallback = allocated_from_environ(uuids)
    count = len(uuids)

    def allocated(uid: int, pid: int) -> set[int] | None:
        w = resolver.for_pid(pid)
        if w.kind == "process":
            return fallback(uid, pid)
        held = {
            g for g in range(count) if (h := resolver.for_gpu(g)) is not None and h.key == w.key
        }
        return held or fallback(uid, pid)

    return allocated


def _own_workload(pid: int) -> str:
    """The workload a private agent's owner works for (its Slurm job from its cgroup or
    environment, else its user: ``uid:<uid>``), for its window log; ``""`` if unreadable."""
    from .slurm import SlurmSource

    key = WorkloadResolver(slurm=SlurmSource()).for_pid(pid).key
    return "" if key == UNKNOWN.key else key


async def _serve(agent: Agent, dec: msgspec.msgpack.Decoder[Any]) -> None:
    # Controls run one at a time, in order, beside the edges (a slow NVML call never delays a
    # window edge).
    # Jobs (a prolog's, an epilog's) have a queue of their own: an epilog waits up to a
    # counter period for its job's figure, and hardware changes must not wait behind it.
    controls_in, controls_out = anyio.create_memory_object_stream[tuple[bytes, Control]](1000)
    jobs_in, jobs_out = anyio.create_memory_object_stream[tuple[bytes, Control]](1000)

    async def control_worker(queue: Any) -> None:
        async for ident, msg in queue:
            await agent.control(ident, msg)

    async with anyio.create_task_group() as tg:
        tg.start_soon(control_worker, controls_out)
        tg.start_soon(control_worker, jobs_out)
        while True:
            frames = await agent.router.recv_multipart(copy=False)
            if len(frames) != 2:
                continue
            ident, data = frames[0].bytes, frames[1].buffer
            try:
                msg = dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("malformed message from a client ignored: %s", exc)
                continue
            if agent.policy is not None and not agent.verify(ident, frames[1]):
                continue
            if isinstance(msg, Edge):
                agent.edge(ident, msg)
            elif isinstance(msg, RequestEdges):
                client = agent.clients.get(ident)
                if client is not None:
                    agent.requests.edges(client, msg)
            elif isinstance(msg, Control):
                jobs = msg.op in ("job_start", "job_end", "jobs")
                await (jobs_in if jobs else controls_in).send((ident, msg))
            elif isinstance(msg, Hello):
                try:
                    agent.hello(ident, msg, peer_credentials(frames[1]))
                except Exception as exc:
                    agent.send(ident, Reply(kind="error", **error_reply_fields(exc)))  # type: ignore[arg-type]
            elif isinstance(msg, Bye) and ident in agent.clients:
                await agent.goodbye(ident)
                if agent.private:
                    agent.stopping.set()


def _socket_path(cfg: AgentConfig) -> Path:
    """The file of an ipc endpoint (a system agent's socket)."""
    if not cfg.endpoint.startswith("ipc://"):
        raise ConfigError(f"a system agent serves an ipc socket, not {cfg.endpoint}")
    return Path(cfg.endpoint[len("ipc://") :])


def main(argv: list[str] | None = None) -> None:
    """Entry point of a private agent (``python -m zeus_async.agent.server CONFIG_JSON``)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="zeus-async agent: %(message)s")
    cfg = msgspec.json.decode(argv[0], type=AgentConfig)
    sys.exit(serve(cfg))


def system_state_dir(cfg: AgentConfig) -> Path:
    """A system agent's state directory: ``cfg.state_dir``, else ``<socket dir>/state``."""
    return Path(cfg.state_dir) if cfg.state_dir else _socket_path(cfg).parent / "state"


def enter_system_dirs(cfg: AgentConfig) -> Path:
    """Make a system agent's directories and point this process's private directory at its
    state directory (its lock, journals and simulated node state go there); that directory.

    Raises:
        ConfigError: Not root, or a directory is unsafe (see
            :func:`.system.prepare_system_dirs`).
    """
    from .system import prepare_system_dirs, require_root

    require_root()
    state = system_state_dir(cfg)
    prepare_system_dirs(_socket_path(cfg), state)
    os.environ[DIR_ENV_VAR] = str(state)
    return state


def serve(
    cfg: AgentConfig, *, ready_line: bool = False, allocated_gpus: AllocatedGpus | None = None
) -> int:
    """Run an agent in this process; returns an exit code (128 + N when signal N stopped it,
    as for any command stopped by a signal).

    A node agent first takes the node lock (exit code :data:`EXIT_AGENT_RUNNING` when another
    node agent holds it) and restores whatever dead processes left changed. A system agent
    (``cfg.system``, root only) first makes its socket and state directories, and keeps its
    lock, journals and simulated node state in the state directory (this process's
    ``ZEUS_ASYNC_DIR`` becomes it).
    """
    if cfg.system:
        try:
            enter_system_dirs(cfg)
        except ConfigError as exc:
            logger.error("%s: %s", type(exc).__name__, exc)
            return 1
    # A private agent's owner handles the terminal's signals; this process must outlive them
    # long enough to restore (it runs in its own session, and ignores SIGINT until its loop
    # installs handlers).
    with contextlib.ExitStack() as stack:
        if cfg.node and not stack.enter_context(_node_lock()):
            logger.error("another node agent is running (%s)", private_dir() / NODE_LOCK)
            return EXIT_AGENT_RUNNING
        try:
            signum = anyio.run(
                functools.partial(
                    run_agent, cfg, ready_line=ready_line, allocated_gpus=allocated_gpus
                ),
                backend="asyncio",
            )
        except Exception as exc:
            exc = sole_exception(exc)  # type: ignore[assignment]
            logger.error("%s: %s", type(exc).__name__, exc)
            return 1
    return 0 if signum is None else 128 + signum


if __name__ == "__main__":
    main()
