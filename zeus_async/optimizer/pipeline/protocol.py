"""The PFO request/reply protocol over ZeroMQ (msgpack-encoded msgspec structs).

A client (DEALER, or REQ) sends ``[b"", request_id, request]``; the server (ROUTER) answers
``[b"", request_id, reply]`` with the same 8-byte ``request_id``. Requests and replies are
tagged unions (field ``type``):

==================  ====================================  =========================================
request             reply                                 when
==================  ====================================  =========================================
``register_job``    ``job`` (the job id)                  rank 0, once; ``job.job_id`` must be ""
``register_rank``   ``ok``                                every rank, once
``get_schedule``    ``schedule``                          every rank, each round; answered when
                                                          the round's schedules are ready (the
                                                          request waits on the server, no polling);
                                                          ``final``: the last schedule, run it
                                                          from then on and report no more
``report``          ``ok``                                every rank, after running a schedule
``info``            ``info``                              any time (``job_id`` "" = all jobs)
==================  ====================================  =========================================

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


class GetSchedule(msgspec.Struct, tag="get_schedule", **_OPTS):
    job_id: str
    rank: int


class ReportProfile(msgspec.Struct, tag="report", **_OPTS):
    job_id: str
    result: ProfilingResult


class Info(msgspec.Struct, tag="info", **_OPTS):
    job_id: str = ""


Request = RegisterJob | RegisterRank | GetSchedule | ReportProfile | Info


class Ok(msgspec.Struct, tag="ok", **_OPTS):
    pass


class JobRegistered(msgspec.Struct, tag="job", **_OPTS):
    job_id: str


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


class InfoReply(msgspec.Struct, tag="info", **_OPTS):
    scheduler: str
    jobs: list[JobStatus]


#: ``code`` of an :class:`ErrorReply`.
ERROR_CODES: Final = (
    "bad_request",  # not a valid request (decode or validation error)
    "unknown_job",  # no such job (never registered, or evicted)
    "bad_rank",  # rank out of range, or not registered
    "duplicate",  # rank registered twice, result reported twice
    "out_of_order",  # e.g. a schedule asked for before reporting the last one
    "scheduler_error",  # the job's scheduler failed; the job is stopped
    "evicted",  # the job was evicted while the request waited
    "shutdown",  # the server is stopping
)


class ErrorReply(msgspec.Struct, tag="error", **_OPTS):
    code: str
    message: str


Reply = Ok | JobRegistered | ScheduleReply | InfoReply | ErrorReply

request_decoder: Final = msgspec.msgpack.Decoder(Request)
reply_decoder: Final = msgspec.msgpack.Decoder(Reply)
encoder: Final = msgspec.msgpack.Encoder()
