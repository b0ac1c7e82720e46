"""The PFO request/reply protocol over ZeroMQ (msgpack-encoded msgspec structs).

A client (DEALER, or REQ) sends ``[b"", request_id, request]``; the server (ROUTER) answers
``[b"", request_id, reply]`` with the same 8-byte ``request_id``. Requests and replies are
tagged unions (field ``type``):

==================  ====================================  =========================================
request             reply                                 when
==================  ====================================  =========================================
``register_job``    ``job`` (the job id and its token)    rank 0, once; ``job.job_id`` must be ""
``register_rank``   ``ok``                                every rank, once
``get_schedule``    ``schedule``                          every rank, each round; answered when
                                                          the round's schedules are ready (the
                                                          request waits on the server, no polling);
                                                          ``final``: the last schedule, run it
                                                          from then on and report no more
``report``          ``ok``                                every rank, after running a schedule
``info``            ``info``                              any time: the job the token opens; every
                                                          job only with the server's admin token
``leave``           none                                  every rank, as it stops (``close``); the
                                                          job ends once all its ranks have left
==================  ====================================  =========================================

**Tokens.** ``register_job`` answers with the job's id and a secret token (random, 32 bytes as
text). Every later request about that job (``register_rank``, ``get_schedule``, ``report``,
``info`` of the job) must carry it; rank 0 shares it with the other ranks the way it shares the
id. A request with a wrong or missing token is refused and touches nothing, so a client cannot
see, take over or disturb another tenant's job. It is refused exactly as a request about a job
that does not exist (``unknown_job``, one message), so probing reveals no job ids either.
``info`` without a job lists no job ids (only how many jobs there are) unless it carries the
server's admin token.

Every failure is an ``error`` reply with a machine-readable ``code`` (:data:`ERROR_CODES`) and a
message; the server goes on serving.
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec

from .messages import FrequencySchedule, JobInfo, ProfilingResult, RankInfo

__all__ = [
    "ERROR_CODES",
    "ErrorReply",
    "GetSchedule",
    "Info",
    "InfoReply",
    "JobRegistered",
    "JobStatus",
    "Leave",
    "Ok",
    "RegisterJob",
    "RegisterRank",
    "Reply",
    "ReportProfile",
    "Request",
    "ScheduleReply",
]

logger = logging.getLogger(__name__)

_OPTS: Final = {"tag_field": "type", "kw_only": True}


class RegisterJob(msgspec.Struct, tag="register_job", **_OPTS):
    job: JobInfo


class RegisterRank(msgspec.Struct, tag="register_rank", **_OPTS):
    job_id: str
    rank: RankInfo
    token: str = ""


class GetSchedule(msgspec.Struct, tag="get_schedule", **_OPTS):
    job_id: str
    rank: int
    token: str = ""


class ReportProfile(msgspec.Struct, tag="report", **_OPTS):
    job_id: str
    result: ProfilingResult
    token: str = ""


class Info(msgspec.Struct, tag="info", **_OPTS):
    job_id: str = ""
    #: The job's token, or (``job_id`` "") the server's admin token.
    token: str = ""


class Leave(msgspec.Struct, tag="leave", **_OPTS):
    """A rank stops (no reply): once every rank of a job has left, the job ends and no longer
    counts against its client's limits."""

    job_id: str
    rank: int
    token: str = ""


Request = RegisterJob | RegisterRank | GetSchedule | ReportProfile | Info | Leave


class Ok(msgspec.Struct, tag="ok", **_OPTS):
    pass


class JobRegistered(msgspec.Struct, tag="job", **_OPTS):
    job_id: str
    #: The secret every later request about this job must carry.
    token: str = ""


class ScheduleReply(msgspec.Struct, tag="schedule", **_OPTS):
    schedule: FrequencySchedule
    #: Round number (0 for the first schedule).
    round: int
    #: The scheduler's last schedule: run it for the rest of training, report nothing more.
    final: bool = False


class JobStatus(msgspec.Struct, kw_only=True):
    job_id: str
    world_size: int
    ranks_registered: int
    round: int
    state: str
    idle_s: float
    error: str = ""
    #: Ranks that have left (the job ends when all have).
    ranks_left: int = 0


class InfoReply(msgspec.Struct, tag="info", **_OPTS):
    scheduler: str
    #: The jobs the request may see (its own; every job with the admin token).
    jobs: list[JobStatus]
    #: How many jobs the server holds.
    jobs_total: int = 0


#: ``code`` of an :class:`ErrorReply`.
ERROR_CODES: Final = (
    "bad_request",  # not a valid request (decode or validation error)
    "unknown_job",  # no job this token opens (never registered, evicted, ended, wrong token)
    "bad_rank",  # rank out of range, or not registered
    "duplicate",  # rank registered twice, result reported twice
    "out_of_order",  # e.g. a schedule asked for before reporting the last one
    "scheduler_error",  # the job's scheduler failed; the job is stopped
    "evicted",  # the job was evicted while the request waited
    "shutdown",  # the server is stopping
    "busy",  # a limit was reached (jobs or memory, on the server or of this client)
)


class ErrorReply(msgspec.Struct, tag="error", **_OPTS):
    code: str
    message: str


Reply = Ok | JobRegistered | ScheduleReply | InfoReply | ErrorReply

request_decoder: Final = msgspec.msgpack.Decoder(Request)
reply_decoder: Final = msgspec.msgpack.Decoder(Reply)
encoder: Final = msgspec.msgpack.Encoder()
