"""The PFO server: plans per-instruction GPU clocks for every rank of pipeline-parallel jobs.

``zeus-async pfo-server --bind tcp://127.0.0.1:7787`` (settings from ``ZEUS_PFO_*``, see
:mod:`.settings`). One ZeroMQ ROUTER socket serves every job (:mod:`.protocol`); each job has
its own anyio task that drives its scheduler round by round:

1. wait (on an event, not a timer) until all ``world_size`` ranks have registered; dump
   ``ranks.json``; build the scheduler;
2. compute the round's schedules (in a worker thread: a planner may take a while, and other
   jobs keep being served), answer every rank's parked ``get_schedule`` request;
3. wait for every rank's profiling result; dump ``<n>.sched.json`` / ``<n>.prof.json``
   (aiofiles); let the scheduler observe them; next round.

A rank's ``get_schedule`` request is simply not answered until its schedule exists: ROUTER
sockets can answer any request later, so waiting costs no polling on either side. Invalid
requests (bad fields, unknown job, a rank registered twice, a schedule asked for before the
last result was reported, ...) get an ``error`` reply with a code; a scheduler failure stops
that job only, and its ranks get the error. Jobs with no request for ``max_job_idle_time``
seconds are evicted (their waiting requests get an ``evicted`` error), and so are jobs whose
ranks have not all registered within ``registration_timeout``. A job ends when all its ranks
have left (``leave``, sent as each rank's optimizer closes).

Tenants share the server safely: a job is opened only by the token its registration returned
(:mod:`.protocol`); jobs are bounded in total (``max_jobs``) and per client
(``max_jobs_per_client``); so is the memory their ranks and results hold (``max_client_mib``,
``max_total_mib``, counted as the decoded objects' size); each client's unread replies are
bounded (:data:`REPLY_QUEUE` messages, then dropped and counted) and so is a request's size
(:data:`MAX_REQUEST_BYTES`, beyond which the client is disconnected); with ``curve_secret``
the socket is a CURVE server, as the bus's publishers are. Tokens never reach the log.

**Who a client is** (the limits' "per client", :func:`peer_of`): the strongest identity the
transport gives, because a weaker one is free to multiply. With CURVE and an allow-list, the
client's public key (ZAP's ``User-Id``); over ipc, the peer process's uid (``SO_PEERCRED``);
over plain TCP, its address, bucketed: all of loopback (127.0.0.0/8, ::1) is one client, since
any local process can pick any of those addresses; else an IPv4 /24 or an IPv6 /64 (one host's
or one site's worth of addresses). CURVE without an allow-list accepts any key, which costs
nothing to make, so there too the address counts.

**Registrations that never finish** hold a place only while places are free: when a limit is
reached, a new registration takes the place of an incomplete one (some ranks not registered)
older than ``registration_grace`` (default 5 s): its own client's oldest, when that client is at
``max_jobs_per_client``; at ``max_jobs``, the oldest of the client holding the most incomplete
registrations, if that client holds more than the newcomer (a flood gives up its places to
others; a client with one slow job keeps it), else the newcomer's own oldest. The evicted job's
waiting requests get ``evicted``; complete jobs are never displaced. So an honest job waits
seconds, not ``registration_timeout``, behind a flood of registrations whose ranks never come.

**Requests waiting to be handled** are bounded in bytes (``max_queue_mib``): the server takes
every complete request from libzmq at once (so libzmq's queues stay short), and one that would
take the queue past the limit is answered ``busy`` and dropped, after the queued requests of the
client holding the most bytes have been dropped (answered ``busy``), newest first, while that
client holds more than this one would. Requests are handled in turn client by client, and at
most :data:`QUEUED_REQUESTS` wait (then the server stops reading and TCP pushes back, as libzmq
queues at most :data:`REQUEST_QUEUE` per connection). What this cannot bound: libzmq receives
a message, all its frames, before the server sees any of it, and ``ZMQ_MAXMSGSIZE`` caps a
frame, not a message, so each connection sending at that moment holds what it has sent so far
(``bench/hostile/bench_pfo_flood.py`` measures 40 clients at once). Where clients are not
trusted, use CURVE with an allow-list (an unknown key is refused before it can send) or an ipc
endpoint.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
import secrets
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import anyio.lowlevel
import msgspec
import zmq

from ...bus._endpoints import check_bind_endpoint
from ...bus._sockets import last_endpoint, poll_in, socket_fd
from ...bus.curve import apply_server_keys, start_authenticator
from ...errors import ConfigError
from . import protocol as p
from .messages import (
    FrequencySchedule,
    JobInfo,
    ProfilingResult,
    RankInfo,
    save_prof,
    save_ranks,
    save_sched,
)
from .schedulers import FrequencyScheduler
from .settings import PfoSettings

__all__ = ["DEFAULT_ENDPOINT", "PfoServer", "peer_of"]

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7787"

#: Replies queued for one client at most: a client that never reads costs the server this
#: many messages, not memory without bound (further replies to it are dropped and counted).
REPLY_QUEUE = 64

#: Complete requests libzmq queues for one connection (``ZMQ_RCVHWM``): the server takes them
#: at once, and when it stops reading (:data:`QUEUED_REQUESTS`), TCP pushes back on the client
#: once this many wait. A client has one request at a time in flight, and a ``leave``.
REQUEST_QUEUE = 16

#: Requests the server's own queue holds at most, however small (each also costs its frames'
#: objects): past it the server stops reading until it has handled some.
QUEUED_REQUESTS = 256

#: Requests read from libzmq in one go before one is handled (a flood of refused requests
#: does not starve the handling of queued ones).
_DRAIN_BATCH = 1024
#: Requests handled before the server's other tasks (jobs, eviction) get their turn.
_HANDLE_BATCH = 64
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

#: The largest request frame accepted (``ZMQ_MAXMSGSIZE``, lowered to ``max_queue_mib`` when
#: that is smaller); a client that sends more is disconnected (a profiling result of 1,000
#: instructions x 10 iterations is ~200 kB).
MAX_REQUEST_BYTES = 16 * 2**20

_Peer = tuple[bytes, bytes]  # (ROUTER identity, request id)


def _property(frame: zmq.Frame, name: str) -> str:
    try:
        return str(frame.get(name) or "")
    except (zmq.ZMQError, UnicodeDecodeError):  # not set (EINVAL): no ZAP, no address
        return ""


def peer_of(frame: zmq.Frame, transport: str, *, keys: bool = True) -> str:
    """Who sent ``frame``, for the per-client limits: ``key <z85>`` (CURVE with an allow-list:
    ZAP's ``User-Id``), ``uid <n>`` (ipc), ``loopback`` or an address block such as
    ``10.1.2.0/24`` (TCP); see the module docstring. ``transport`` is the server's (``tcp``);
    ``keys``: whether a ZAP handler may have set a ``User-Id`` (else it is not looked for)."""
    user = _property(frame, "User-Id") if keys else ""
    if user:
        return f"key {user}"
    return _peer_of_address(transport, _property(frame, "Peer-Address"))


@functools.lru_cache(maxsize=4096)
def _peer_of_address(transport: str, address: str) -> str:
    if transport == "ipc":
        # libzmq appends the peer's SO_PEERCRED: "localhost:<uid>:<gid>:<pid>". The uid is the
        # principal: every process of one user is one client.
        fields = address.split(":")
        if len(fields) >= 4 and fields[-3].isdigit():
            return f"uid {fields[-3]}"
        return "ipc"  # no credentials on this platform: every local client is one
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address)
    except ValueError:
        return address or transport  # inproc, or a transport without addresses
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"  # any local process can use any of 127.0.0.0/8 (and ::1)
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ipaddress.IPv4Network((int(ip), 24), strict=False))
    return str(ipaddress.IPv6Network((int(ip), 64), strict=False))


class _Head(msgspec.Struct):
    """What a request is about: read first, skipping the rest (a skim of a 15 MiB report
    takes ~4 ms and allocates nothing), so that a request about a job its token does not open
    is refused before it is decoded in full (~0.2 s and ~55 MiB of objects for that report)."""

    type: str = ""
    job_id: str = ""
    token: str = ""


_head_decoder = msgspec.msgpack.Decoder(_Head)
#: Requests about a job, opened only by its token.
_JOB_REQUESTS = frozenset({"register_rank", "get_schedule", "report", "leave"})
#: Requests larger than this are skimmed first (a smaller one is decoded in a few µs anyway).
_SKIM_FROM = 64 * 1024


@dataclass(eq=False, slots=True)
class _Request:
    """A request taken from the socket and not yet handled."""

    peer: _Peer
    client: str
    payload: zmq.Frame
    size: int


def _describe(message: object) -> str:
    """A request or reply for a debug line: its type and fields, long values shortened, and
    never a token (a debug log is no place for secrets)."""
    token: object = getattr(message, "token", None)
    if isinstance(message, msgspec.Struct) and isinstance(token, str) and token:
        message = msgspec.structs.replace(message, token="<hidden>")
    text = repr(message)
    return text if len(text) <= 300 else text[:297] + "..."


_MAX_METADATA = 100

# What a decoded message holds in memory, per list and per number in it (CPython objects, the
# list's pointer, and a scheduler's own list of a rank's clocks), for the memory limits;
# measured with tracemalloc (bench/pfo/bench_pfo_memory.py), rounded up.
_LIST_BYTES = 72
_NUMBER_BYTES = 52
_STRUCT_BYTES = 256
#: Besides its registration, what a rank costs the server and its scheduler (table entries,
#: the scheduler's per-rank and per-stage state), measured with 5,000 one-clock ranks.
_RANK_STATE_BYTES = 2048
#: A schedule's entry: an (instruction, MHz) tuple and the list's pointer to it.
_ENTRY_BYTES = 72


def _schedule_footprint(schedule: FrequencySchedule) -> int:
    return _STRUCT_BYTES + _LIST_BYTES + _ENTRY_BYTES * len(schedule.frequencies)


def _footprint(message: RankInfo | ProfilingResult) -> int:
    """Bytes ``message`` holds once decoded (an upper estimate, see the constants); a rank's
    also covers the state the server and scheduler keep for it."""
    if isinstance(message, RankInfo):
        return (
            _RANK_STATE_BYTES
            + _STRUCT_BYTES
            + _LIST_BYTES
            + _NUMBER_BYTES * len(message.available_frequencies)
        )
    lists, numbers = 2, len(message.iter_time) + len(message.iter_energy)
    for breakdown in (message.time_breakdown, message.energy_breakdown):
        for iterations in breakdown.values():
            lists += 1 + len(iterations)
            numbers += sum(len(times) for times in iterations)
    return _STRUCT_BYTES + _LIST_BYTES * lists + _NUMBER_BYTES * numbers


def _check_result(result: ProfilingResult, schedule: FrequencySchedule) -> str:
    """Why ``result`` cannot be a measurement of ``schedule`` ("" when it can)."""
    if not result.time_breakdown:
        return ""  # iteration figures only: accepted (a scheduler may need more, and says so)
    expected = Counter(name for name, _ in schedule.frequencies)
    if set(result.time_breakdown) != set(expected):
        return (
            f"the result times instructions {sorted(result.time_breakdown)}, the schedule has "
            f"{sorted(expected)}"
        )
    for name, iterations in result.time_breakdown.items():
        if len(iterations) != len(result.iter_time):
            return f"{name!r} is timed in {len(iterations)} iterations, not {len(result.iter_time)}"
        for times in iterations:
            if len(times) != expected[name]:
                return (
                    f"an iteration times {len(times)} {name!r}, the schedule has {expected[name]}"
                )
            if min(times, default=1.0) <= 0:
                return f"a {name!r} time is not positive"
    return ""


class _Failure(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Job:
    info: JobInfo
    last_active: float
    token: str = ""
    owner: str = ""
    created: float = 0.0
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    left: set[int] = field(default_factory=set)
    #: Memory held by the ranks' registrations and by this round's results (bytes).
    rank_bytes: int = 0
    result_bytes: int = 0
    schedule_bytes: int = 0
    all_registered: anyio.Event = field(default_factory=anyio.Event)
    state: str = "registering"  # registering, planning, running, failed
    round: int = -1
    schedules: dict[int, FrequencySchedule] = field(default_factory=dict)
    fetched: set[int] = field(default_factory=set)
    parked: dict[int, _Peer] = field(default_factory=dict)
    results: dict[int, ProfilingResult] = field(default_factory=dict)
    all_reported: anyio.Event = field(default_factory=anyio.Event)
    error: str = ""
    final: bool = False
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


def _incomplete(job: _Job) -> bool:
    """Whether some of ``job``'s ranks have not registered (its task may not have run yet)."""
    return job.state == "registering" and len(job.ranks) < job.info.world_size


class PfoServer:
    """The server; ``await server.serve()`` runs it until cancelled.

    Args:
        settings: Server settings (default: from the environment).
        endpoint: ZeroMQ endpoint to bind (loopback by default; another host's clients need a
            routable address).
        clock: Monotonic seconds, for idle eviction (tests pass a fake one).
        evict_period_s: How often idle jobs are looked for (default: a tenth of
            ``max_job_idle_time``, at most 60 s).
    """

    def __init__(
        self,
        settings: PfoSettings | None = None,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        clock: Callable[[], float] = time.monotonic,
        evict_period_s: float | None = None,
    ) -> None:
        self.settings = settings or PfoSettings.from_env()
        self.scheduler_cls: type[FrequencyScheduler] = self.settings.scheduler_class()
        self._endpoint = endpoint
        self._clock = clock
        idle = self.settings.max_job_idle_time
        self._evict_period = evict_period_s or min(
            60.0, idle / 10, self.settings.registration_timeout / 10
        )
        self.jobs: dict[str, _Job] = {}
        self._curve = self.settings.curve_keys()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._auth: Any = None
        self._sock: zmq.Socket[Any] | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.endpoint: str | None = None
        self.requests_served = 0
        #: Replies dropped because their client's queue was full or the client had gone.
        self.replies_dropped = 0
        #: Requests refused for a wrong or missing token.
        self.requests_forbidden = 0
        #: Requests answered ``busy`` because the request queue was full (max_queue_mib).
        self.requests_refused = 0
        #: Incomplete registrations evicted to make room for a new one (registration_grace).
        self.registrations_displaced = 0
        self._transport = endpoint.partition("://")[0].lower()
        self._queue_limit = int(self.settings.max_queue_mib * 2**20)
        #: Requests waiting to be handled, per client in arrival order; the dict's order is
        #: the turn in which clients are served.
        self._queue: dict[str, deque[_Request]] = {}
        self._queued_by: Counter[str] = Counter()  # bytes queued per client
        self._queued_bytes = 0
        self._queued_count = 0
        #: The most bytes the request queue has held.
        self.queued_bytes_peak = 0

    # -- lifecycle --------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the socket (done by :meth:`serve` if not yet); returns the bound endpoint."""
        if self._sock is None:
            curve = self._curve is not None
            check_bind_endpoint(self._endpoint, curve=curve, require_curve=False, what="pfo-server")
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, REPLY_QUEUE)
            sock.setsockopt(zmq.RCVHWM, REQUEST_QUEUE)
            # A frame that could never fit the request queue is refused as its header arrives.
            sock.setsockopt(zmq.MAXMSGSIZE, min(MAX_REQUEST_BYTES, self._queue_limit))
            # A full or vanished client is an error to count, not a silent drop.
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if self._curve is not None:
                self._auth = start_authenticator(self._ctx, self._curve)
                apply_server_keys(sock, self._curve)
            try:
                sock.bind(self._endpoint)
            except zmq.ZMQError as exc:
                sock.close()
                raise ConfigError(f"cannot bind {self._endpoint}: {exc}") from None
            self._sock = sock
            self.endpoint = last_endpoint(sock)
            logger.info(
                "PFO server on %s%s, scheduler %s",
                self.endpoint,
                " (CURVE)" if curve else "",
                self.scheduler_cls.__name__,
            )
        assert self.endpoint is not None
        return self.endpoint

    async def serve(self) -> None:
        """Serve until cancelled; then every waiting request gets a ``shutdown`` error."""
        self.bind()
        sock = self._sock
        assert sock is not None
        fd = socket_fd(sock)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._evict_loop)
                while True:
                    # Take what libzmq holds before handling each request: a large request
                    # waits in the byte-bounded queue, or is refused and freed, not kept in
                    # libzmq. Other tasks run after each batch.
                    self._drain(sock)
                    for _ in range(_HANDLE_BATCH):
                        if not self._queued_count:
                            break
                        await self._handle(self._next_request())  # (does not yield)
                        self._drain(sock)
                    await anyio.lowlevel.checkpoint()
                    if not self._queued_count and not poll_in(sock):
                        await anyio.wait_readable(fd)
        finally:
            self._tg = None
            for job in self.jobs.values():
                self._fail_parked(job, "shutdown", "the PFO server is stopping")
            self._queue.clear()
            self._queued_by.clear()
            self._queued_bytes = self._queued_count = 0
            sock.close(linger=0)
            self._sock = None
            if self._auth is not None:
                self._auth.stop()
                self._auth = None

    # -- requests ---------------------------------------------------------------------------

    def _send(self, peer: _Peer, reply: p.Reply) -> None:
        if self._sock is None:
            return
        identity, req_id = peer
        try:
            self._sock.send_multipart([identity, b"", req_id, p.encoder.encode(reply)], zmq.NOBLOCK)
        except zmq.Again:  # that client's queue is full: it does not read its replies
            self.replies_dropped += 1
            logger.debug("pfo-server: reply dropped: the client's queue is full")
        except zmq.ZMQError as exc:  # the client has gone (EHOSTUNREACH)
            self.replies_dropped += 1
            logger.debug("pfo-server: reply dropped: %s", exc)

    # -- the request queue -------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        """Take the requests libzmq holds (up to :data:`QUEUED_REQUESTS` queued): each is
        queued, or refused at once."""
        for _ in range(_DRAIN_BATCH):
            if self._queued_count >= QUEUED_REQUESTS or not cast(int, sock.get(_EVENTS)) & _POLLIN:
                return  # (what poll_in reads, at half the cost: this runs for every request)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._take(frames)

    def _take(self, frames: list[zmq.Frame]) -> None:
        # [identity, b"", request_id, payload] (DEALER/REQ envelope)
        if len(frames) != 4 or len(frames[1]) != 0:
            self.requests_served += 1
            bad: _Peer = (frames[0].bytes, frames[-2].bytes if len(frames) >= 3 else b"")
            self._send(bad, p.ErrorReply(code="bad_request", message="malformed envelope"))
            return
        client = peer_of(frames[3], self._transport, keys=self._auth is not None)
        request = _Request(
            peer=(frames[0].bytes, frames[2].bytes),
            client=client,
            payload=frames[3],
            size=len(frames[0]) + len(frames[2]) + len(frames[3]),
        )
        if not self._make_queue_room(request):
            self._refuse(request)
            return
        queue = self._queue.get(client)
        if queue is None:
            queue = self._queue[client] = deque()
        queue.append(request)
        self._queued_by[client] += request.size
        self._queued_bytes += request.size
        self._queued_count += 1
        self.queued_bytes_peak = max(self.queued_bytes_peak, self._queued_bytes)

    def _make_queue_room(self, request: _Request) -> bool:
        """Whether ``request`` fits the queue, once the newest requests of the client holding
        the most bytes are dropped while that client holds more than this one would."""
        if request.size > self._queue_limit:
            return False
        while self._queued_bytes + request.size > self._queue_limit:
            heavy = max(self._queue, key=self._queued_by.__getitem__)  # <= QUEUED_REQUESTS
            if heavy == request.client or (
                self._queued_by[heavy] <= self._queued_by[request.client] + request.size
            ):
                return False
            self._refuse(self._unqueue(heavy, newest=True))
        return True

    def _next_request(self) -> _Request:
        """The next request to handle: clients take turns, each's in arrival order."""
        return self._unqueue(next(iter(self._queue)), newest=False)

    def _unqueue(self, client: str, *, newest: bool) -> _Request:
        queue = self._queue.pop(client)
        request = queue.pop() if newest else queue.popleft()
        if queue:
            self._queue[client] = queue  # to the back of the turn
            self._queued_by[client] -= request.size
        else:
            del self._queued_by[client]
        self._queued_bytes -= request.size
        self._queued_count -= 1
        return request

    def _refuse(self, request: _Request) -> None:
        self.requests_refused += 1
        limit = self.settings.max_queue_mib
        logger.debug(
            "request of %d bytes from %s refused: the request queue is full", request.size,
            request.client,
        )  # fmt: skip
        self._send(
            request.peer,
            p.ErrorReply(
                code="busy",
                message=(
                    f"the server's queue of requests waiting to be handled is full "
                    f"({limit:g} MiB, max_queue_mib; this request is {request.size} bytes): "
                    "try again shortly"
                ),
            ),
        )

    # -- requests ---------------------------------------------------------------------------

    async def _handle(self, queued: _Request) -> None:
        self.requests_served += 1
        peer, client = queued.peer, queued.client
        try:
            if len(queued.payload) > _SKIM_FROM:
                head = _head_decoder.decode(queued.payload.buffer)
                if head.type in _JOB_REQUESTS:
                    self._opened(head.job_id, head.token)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # the full decode says what is wrong
        except _Failure as exc:
            del queued.payload
            logger.debug("reply error %s: %s", exc.code, exc)
            self._send(peer, p.ErrorReply(code=exc.code, message=str(exc)))
            return
        try:
            request = p.request_decoder.decode(queued.payload.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.debug("bad request (%d bytes): %s", len(queued.payload), exc)
            self._send(peer, p.ErrorReply(code="bad_request", message=str(exc)))
            return
        finally:
            del queued.payload  # the frame's memory goes back now, not when the loop next runs
        debug = logger.isEnabledFor(logging.DEBUG)
        if debug:
            logger.debug("request %s", _describe(request))
        try:
            reply = self._dispatch(request, peer, client)
        except _Failure as exc:
            logger.debug("reply error %s: %s", exc.code, exc)
            self._send(peer, p.ErrorReply(code=exc.code, message=str(exc)))
            return
        if reply is not None:
            if debug:
                logger.debug("reply %s", _describe(reply))
            self._send(peer, reply)
        elif debug and isinstance(request, p.GetSchedule):
            logger.debug("parked until its schedule exists")

    def _job(self, job_id: str, token: str, *, failed_too: bool = False) -> _Job:
        job = self._opened(job_id, token)
        job.last_active = self._clock()
        if job.state == "failed" and not failed_too:
            raise _Failure("scheduler_error", f"job {job_id!r} failed: {job.error}")
        return job

    def _opened(self, job_id: str, token: str) -> _Job:
        """The job ``token`` opens, else ``unknown_job``."""
        job = self.jobs.get(job_id)
        if job is None or not hmac.compare_digest(job.token.encode(), token.encode()):
            # One answer for both: a wrong token tells nothing about which job ids exist.
            if job is not None:
                self.requests_forbidden += 1
            raise _Failure(
                "unknown_job",
                f"no job {job_id!r} that this token opens (never registered, evicted, ended, "
                "or the token is another job's)",
            )
        return job

    def _dispatch(self, request: p.Request, peer: _Peer, client: str = "") -> p.Reply | None:
        if isinstance(request, p.RegisterJob):
            return self._register_job(request.job, client)
        if isinstance(request, p.Info):
            return self._info(request.job_id, request.token)
        # A failed job's ranks may still leave it (and so end it).
        job = self._job(request.job_id, request.token, failed_too=isinstance(request, p.Leave))
        if isinstance(request, p.RegisterRank):
            return self._register_rank(job, request.rank)
        if isinstance(request, p.GetSchedule):
            return self._get_schedule(job, request.rank, peer)
        if isinstance(request, p.Leave):
            self._leave(job, request.rank)
            return None
        return self._report(job, request.result)

    def _held(self, owner: str | None = None) -> int:
        """Bytes held by the jobs of ``owner`` (every job's with ``None``)."""
        return sum(
            j.rank_bytes + j.result_bytes + j.schedule_bytes
            for j in self.jobs.values()
            if owner is None or j.owner == owner
        )

    def _check_memory(self, job: _Job, adding: int) -> None:
        """Refuse (``busy``) what would take the job's client or the server past its memory
        limit; the job's owner is charged, whoever sends its ranks' requests."""
        mib = 2**20
        limits = self.settings
        if self._held(job.owner) + adding > limits.max_client_mib * mib:
            raise _Failure(
                "busy",
                f"job {job.info.job_id}: its client's jobs would hold over "
                f"{limits.max_client_mib:g} MiB of ranks, results and schedules (max_client_mib)",
            )
        if self._held() + adding > limits.max_total_mib * mib:
            raise _Failure(
                "busy",
                f"job {job.info.job_id}: the server's jobs would hold over "
                f"{limits.max_total_mib:g} MiB of ranks, results and schedules (max_total_mib)",
            )

    def _leave(self, job: _Job, rank: int) -> None:
        if rank not in job.ranks:
            raise _Failure("bad_rank", f"job {job.info.job_id}: rank {rank} has not registered")
        job.left.add(rank)
        if self._all_left(job):
            if job.state == "planning":
                # Its planner runs in a thread that cannot be stopped: the job (and its place
                # in the limits) stays until the plan returns, then ends (_run_job).
                return
            self._end(job)

    def _end(self, job: _Job) -> None:
        self.jobs.pop(job.info.job_id, None)
        job.scope.cancel()
        self._fail_parked(job, "evicted", f"job {job.info.job_id} ended: all its ranks have left")
        logger.info("job %s ended: all its ranks have left", job.info.job_id)

    def _all_left(self, job: _Job) -> bool:
        return len(job.ranks) == job.info.world_size and job.left >= set(job.ranks)

    def _make_job_room(self, client: str) -> None:
        """Make room for a job of ``client`` under the job limits, evicting an incomplete
        registration older than ``registration_grace`` if need be (see the module docstring);
        else refuse with ``busy``."""
        limits = self.settings
        grace = limits.registration_grace
        held = sum(1 for j in self.jobs.values() if j.owner == client)
        if held >= limits.max_jobs_per_client:
            victim = self._stale_registrations().get(client)
            if victim is None:
                raise _Failure(
                    "busy",
                    f"{held} jobs are registered from this client ({client}), the most one "
                    "client may hold (max_jobs_per_client), and none is a registration left "
                    f"incomplete for {grace:g} s (registration_grace). A job ends when all its "
                    f"ranks close their optimizer, else after {limits.max_job_idle_time:g} s "
                    "without a request (max_job_idle_time); clients are told apart by their "
                    "CURVE key when the server checks keys, by uid over ipc, else by address "
                    "(all of loopback is one client, else an IPv4 /24 or an IPv6 /64)",
                )
            self._displace(victim, client)
        elif len(self.jobs) >= limits.max_jobs:
            stale = self._stale_registrations()
            incomplete = Counter(j.owner for j in self.jobs.values() if _incomplete(j))
            # The client holding the most incomplete registrations gives up its oldest stale
            # one, if it holds more than the newcomer; else the newcomer gives up its own.
            heavy = max(stale, key=lambda c: (incomplete[c], -stale[c].created), default=None)
            if heavy is not None and incomplete[heavy] > incomplete[client]:
                self._displace(stale[heavy], client)
            elif client in stale:
                self._displace(stale[client], client)
            else:
                raise _Failure(
                    "busy",
                    f"the server holds its maximum of {limits.max_jobs} jobs (max_jobs), and no "
                    "client holding more incomplete registrations than this one has left one "
                    f"incomplete for {grace:g} s (registration_grace)",
                )

    def _stale_registrations(self) -> dict[str, _Job]:
        """Each client's oldest job whose ranks have not all registered within
        ``registration_grace``."""
        oldest_allowed = self._clock() - self.settings.registration_grace
        stale: dict[str, _Job] = {}
        for job in self.jobs.values():  # in registration order
            if _incomplete(job) and job.created <= oldest_allowed:
                stale.setdefault(job.owner, job)
        return stale

    def _displace(self, job: _Job, client: str) -> None:
        self.registrations_displaced += 1
        self._evict(
            job,
            f"job {job.info.job_id}: {len(job.ranks)} of its {job.info.world_size} ranks "
            f"registered within {self._clock() - job.created:.3g} s, and the server's job limits "
            f"were reached: its place went to a new job of {client}",
        )

    def _evict(self, job: _Job, reason: str) -> None:
        self.jobs.pop(job.info.job_id, None)
        job.scope.cancel()
        self._fail_parked(job, "evicted", reason)
        logger.info("evicted: %s", reason)

    def _register_job(self, info: JobInfo, client: str = "") -> p.Reply:
        if info.job_id:
            raise _Failure("bad_request", "job_id must be empty when registering a job")
        meta = info.job_metadata or ""
        if len(meta) > _MAX_METADATA or not all(c.isprintable() and c not in "/\\" for c in meta):
            raise _Failure(
                "bad_request",
                f"job_metadata must be at most {_MAX_METADATA} printable characters without "
                "slashes (it becomes part of the job id and of a folder name)",
            )
        self._make_job_room(client)  # last: a request refused for its fields evicts nothing
        base = info.make_job_id(self.scheduler_cls.__name__, datetime.now())
        job_id, n = base, 1
        dump = Path(self.settings.dump_dir)
        # Same second, same shape: keep ids unique, and clear of an ended job's dump folder.
        while job_id in self.jobs or (self.settings.dump_data and (dump / job_id).exists()):
            n += 1
            stamp, _, rest = base.partition("+")
            job_id = f"{stamp}.{n}+{rest}"
        info = msgspec.structs.replace(info, job_id=job_id)
        now = self._clock()
        token = secrets.token_urlsafe(32)
        job = _Job(info=info, last_active=now, token=token, owner=client, created=now)
        self.jobs[job_id] = job
        assert self._tg is not None
        self._tg.start_soon(self._run_job, job)
        logger.info("job %s registered (%d ranks) by %s", job_id, info.world_size, client)
        return p.JobRegistered(job_id=job_id, token=token)

    def _register_rank(self, job: _Job, rank: RankInfo) -> p.Reply:
        job_id = job.info.job_id
        try:
            rank.check_against(job.info)
        except ValueError as exc:
            raise _Failure("bad_rank", f"job {job_id}: {exc}") from None
        if rank.rank in job.ranks:
            raise _Failure("duplicate", f"job {job_id}: rank {rank.rank} is already registered")
        size = _footprint(rank)
        self._check_memory(job, size)
        job.rank_bytes += size
        job.ranks[rank.rank] = rank
        if len(job.ranks) == job.info.world_size:
            job.all_registered.set()
        return p.Ok()

    def _get_schedule(self, job: _Job, rank: int, peer: _Peer) -> p.Reply | None:
        job_id = job.info.job_id
        if rank not in job.ranks:
            raise _Failure("bad_rank", f"job {job_id}: rank {rank} has not registered")
        if rank in job.parked:
            raise _Failure("duplicate", f"job {job_id}: rank {rank} is already waiting")
        if job.state == "done":  # the last schedule, as often as asked
            return self._hand_out(job, rank)
        if rank in job.fetched and rank not in job.results:
            raise _Failure(
                "out_of_order",
                f"job {job_id}: rank {rank} asked for a new schedule before reporting the "
                f"profiling result of round {job.round}",
            )
        if job.state == "running" and rank not in job.fetched:
            return self._hand_out(job, rank)
        job.parked[rank] = peer  # answered when the round's schedules are ready
        return None

    def _hand_out(self, job: _Job, rank: int) -> p.Reply:
        job.fetched.add(rank)
        job.last_active = self._clock()
        return p.ScheduleReply(schedule=job.schedules[rank], round=job.round, final=job.final)

    def _report(self, job: _Job, result: ProfilingResult) -> p.Reply:
        job_id = job.info.job_id
        if result.rank not in job.ranks:
            raise _Failure("bad_rank", f"job {job_id}: rank {result.rank} has not registered")
        if result.rank not in job.fetched:
            raise _Failure(
                "out_of_order",
                f"job {job_id}: rank {result.rank} reported a result without a schedule "
                f"for round {job.round}",
            )
        if job.state == "done":
            raise _Failure(
                "out_of_order", f"job {job_id}: the schedule is final; nothing is to be reported"
            )
        if result.rank in job.results:
            raise _Failure(
                "duplicate", f"job {job_id}: rank {result.rank} already reported round {job.round}"
            )
        problem = _check_result(result, job.schedules[result.rank])
        if problem:
            raise _Failure("bad_request", f"job {job_id}: rank {result.rank}: {problem}")
        size = _footprint(result)
        self._check_memory(job, size)
        job.result_bytes += size
        job.results[result.rank] = result
        if len(job.results) == job.info.world_size:
            job.all_reported.set()
        return p.Ok()

    def _info(self, job_id: str, token: str) -> p.Reply:
        admin = self.settings.admin_token
        is_admin = bool(admin) and hmac.compare_digest(admin.encode(), token.encode())
        if job_id:
            if not is_admin:
                self._job(job_id, token)  # only the job's token opens it
            elif job_id not in self.jobs:
                raise _Failure("unknown_job", f"no job {job_id!r} on this server")
        elif not is_admin:
            return p.InfoReply(
                scheduler=self.scheduler_cls.__name__, jobs=[], jobs_total=len(self.jobs)
            )
        now = self._clock()
        jobs = [
            p.JobStatus(
                job_id=j.info.job_id,
                world_size=j.info.world_size,
                ranks_registered=len(j.ranks),
                round=j.round,
                state=j.state,
                idle_s=max(0.0, now - j.last_active),
                error=j.error,
                ranks_left=len(j.left),
            )
            for j in self.jobs.values()
            if not job_id or j.info.job_id == job_id
        ]
        return p.InfoReply(
            scheduler=self.scheduler_cls.__name__, jobs=jobs, jobs_total=len(self.jobs)
        )

    # -- per-job task -----------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        job_id = job.info.job_id
        dump = Path(self.settings.dump_dir) / job_id if self.settings.dump_data else None
        with job.scope:
            try:
                await job.all_registered.wait()
                ranks = [job.ranks[r] for r in sorted(job.ranks)]
                if dump is not None:
                    with anyio.CancelScope(shield=True):  # a stopping server finishes its dumps
                        await save_ranks(ranks, dump)
                job.state = "planning"
                # Planning runs in worker threads; a stopping server does not wait for it.
                scheduler = await anyio.to_thread.run_sync(
                    lambda: self.scheduler_cls(
                        job.info, ranks, self.settings, **self.settings.scheduler_args
                    ),
                    abandon_on_cancel=True,
                )
                while True:
                    schedules = await anyio.to_thread.run_sync(
                        scheduler.next_schedule, abandon_on_cancel=True
                    )
                    if self._all_left(job):  # every rank left while it planned
                        self._end(job)
                        return
                    job.schedule_bytes = 0
                    size = sum(_schedule_footprint(s) for s in schedules)
                    self._check_memory(job, size)
                    job.schedule_bytes = size
                    by_rank = {s.rank: s for s in schedules}
                    if sorted(by_rank) != list(range(job.info.world_size)):
                        raise RuntimeError(
                            f"the scheduler returned schedules for ranks {sorted(by_rank)}, "
                            f"expected 0..{job.info.world_size - 1}"
                        )
                    job.round += 1
                    job.final = scheduler.finished
                    job.schedules, job.fetched, job.results = by_rank, set(), {}
                    job.result_bytes = 0
                    job.all_reported = anyio.Event()
                    job.state = "done" if job.final else "running"
                    job.last_active = self._clock()
                    for rank, peer in list(job.parked.items()):
                        del job.parked[rank]
                        self._send(peer, self._hand_out(job, rank))
                    # Dumps wait until the round's requests are answered: no file I/O while
                    # every rank is asking for its schedule.
                    scheds = [by_rank[r] for r in sorted(by_rank)]
                    if job.final:  # the scheduler is done: no more rounds, nothing to report
                        logger.info("job %s: final schedule (round %d)", job_id, job.round)
                        if dump is not None:
                            with anyio.CancelScope(shield=True):
                                await save_sched(scheds, dump, job.round)
                        return
                    await job.all_reported.wait()
                    job.last_active = self._clock()
                    results = [job.results[r] for r in sorted(job.results)]
                    if dump is not None:
                        with anyio.CancelScope(shield=True):
                            await save_sched(scheds, dump, job.round)
                            await save_prof(results, dump, job.round)
                    job.state = "planning"
                    await anyio.to_thread.run_sync(
                        scheduler.observe, results, abandon_on_cancel=True
                    )
            except Exception as exc:
                if self._all_left(job):  # nobody is left to be told, or to leave it again
                    self._end(job)
                    return
                job.state = "failed"
                if isinstance(exc, _Failure):  # a limit: said in one line
                    job.error = str(exc)
                    logger.error("job %s failed: %s", job_id, job.error)
                else:
                    job.error = f"{type(exc).__name__}: {exc}"
                    logger.error(
                        "job %s: scheduler failed: %s\n%s",
                        job_id,
                        job.error,
                        traceback.format_exc(),
                    )
                self._fail_parked(job, "scheduler_error", f"job {job_id} failed: {job.error}")

    def _fail_parked(self, job: _Job, code: str, message: str) -> None:
        for peer in job.parked.values():
            self._send(peer, p.ErrorReply(code=code, message=message))
        job.parked.clear()

    # -- eviction ---------------------------------------------------------------------------

    def evict_idle(self) -> list[str]:
        """Evict the jobs idle for longer than ``max_job_idle_time``, those whose ranks have
        not all registered within ``registration_timeout``, and failed jobs no rank has asked
        about for ``registration_timeout`` (time enough to learn the error); returns their
        ids."""
        now, limit = self._clock(), self.settings.max_job_idle_time
        register_limit = self.settings.registration_timeout
        reasons: dict[str, str] = {}
        for jid, j in self.jobs.items():
            if j.state == "registering" and now - j.created > register_limit:
                reasons[jid] = (
                    f"job {jid}: {len(j.ranks)} of its {j.info.world_size} ranks registered "
                    f"within {register_limit:g} s"
                )
            elif j.state == "failed" and now - j.last_active > register_limit:
                reasons[jid] = (
                    f"job {jid} failed, and no rank asked about it for {register_limit:g} s"
                )
            elif now - j.last_active > limit and (j.state != "planning" or self._all_left(j)):
                # A plan takes a while; one that outlives its ranks by max_job_idle_time goes.
                reasons[jid] = f"job {jid} was idle for over {limit:g} s"
        for job_id, reason in reasons.items():
            self._evict(self.jobs[job_id], reason)
        return list(reasons)

    async def _evict_loop(self) -> None:
        while True:
            await anyio.sleep(self._evict_period)
            self.evict_idle()
