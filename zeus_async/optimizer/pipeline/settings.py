"""PFO server settings, read from ``ZEUS_PFO_*`` environment variables.

=============================  ======================================================  ==========
variable                       meaning                                                 default
=============================  ======================================================  ==========
``ZEUS_PFO_SCHEDULER``         scheduler name (:data:`~.schedulers.SCHEDULERS`), or    PointSolution
                               ``package.module:Class`` for your own
``ZEUS_PFO_SCHEDULER_ARGS``    JSON object of extra constructor arguments              ``{}``
``ZEUS_PFO_LOG_LEVEL``         ``debug``, ``info``, ... (upper-cased)                  INFO
``ZEUS_PFO_DUMP_DATA``         write ranks, schedules and profiles to ``dump_dir``     true
``ZEUS_PFO_DUMP_DIR``          where to write them (one folder per job)                ./dump
``ZEUS_PFO_MAX_JOB_IDLE_TIME`` seconds without a request before a job is evicted       604800
``ZEUS_PFO_REGISTRATION_TIMEOUT`` seconds for all of a job's ranks to register, else     600
                               the job is evicted (never-used jobs do not linger)
``ZEUS_PFO_REGISTRATION_GRACE`` seconds a job whose ranks have not all registered      5
                               keeps its place when the job limits are reached; after
                               that a new registration may take it (see the server)
``ZEUS_PFO_MAX_JOBS``          jobs the server holds at most (then ``busy``)           1000
``ZEUS_PFO_MAX_JOBS_PER_CLIENT`` jobs one client holds at most (its CURVE key, its uid   64
                               over ipc, else its address: loopback, IPv4 /24, IPv6
                               /64); a job ends when its ranks close
``ZEUS_PFO_MAX_CLIENT_MIB``    memory one client's jobs may hold (ranks, results), MiB  256
``ZEUS_PFO_MAX_TOTAL_MIB``     memory all jobs may hold together, MiB                   2048
``ZEUS_PFO_MAX_QUEUE_MIB``     requests received and not yet handled, MiB (past it:     64
                               ``busy``)
``ZEUS_PFO_ADMIN_TOKEN``       a token whose ``info`` lists every job (empty: none)    ""
``ZEUS_PFO_CURVE_SECRET``      the server's CURVE secret certificate (encrypts TCP)    none
``ZEUS_PFO_CURVE_ALLOW``       directory of the client certificates allowed            none
=============================  ======================================================  ==========

These are the defaults of :class:`PfoSettings` (the seed's). ``zeus-async pfo-server`` differs
in two: it asks for a scheduler when none is chosen (no option, no variable: every scheduler
needs something about the job, the planner its microbatches, a plan server its plan), and it
writes job state only when asked (``--dump DIR``, or ``ZEUS_PFO_DUMP_DATA`` or
``ZEUS_PFO_DUMP_DIR`` set), not into ``./dump`` of whatever directory it was started from.

Names are read in any case (``zeus_pfo_dump_dir``; the upper-case spelling wins when both are
set) and booleans as ``1/0``, ``true/false``, ``yes/no``, ``on/off``, ``t/f``, ``y/n``, as the
seed's pydantic settings read them.

The scheduler arguments are checked against the scheduler's constructor when the settings are
made, so a typo fails at server start with the constructor's signature in the message, not at
the first job.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from ...errors import ConfigError
from .schedulers import FrequencyScheduler, scheduler_class

__all__ = ["ENV_PREFIX", "PfoSettings"]

logger = logging.getLogger(__name__)

ENV_PREFIX = "ZEUS_PFO_"
_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")
# What pydantic-settings (the seed's settings) accepts, case-insensitively.
_TRUE = ("1", "true", "yes", "on", "t", "y")
_FALSE = ("0", "false", "no", "off", "f", "n")


class PfoSettings(msgspec.Struct, kw_only=True, frozen=True):
    """Validated PFO server settings (see the module docstring); use :meth:`from_env`."""

    scheduler: str = "PointSolution"
    scheduler_args: dict[str, Any] = {}
    log_level: str = "INFO"
    dump_data: bool = True
    dump_dir: str = "./dump"
    max_job_idle_time: float = 7 * 24 * 3600.0
    registration_timeout: float = 600.0
    registration_grace: float = 5.0
    max_jobs: int = 1000
    max_jobs_per_client: int = 64
    max_client_mib: float = 256.0
    max_total_mib: float = 2048.0
    max_queue_mib: float = 64.0
    admin_token: str = ""
    curve_secret: str | None = None
    curve_allow: str | None = None

    def __post_init__(self) -> None:
        level = self.log_level.upper()
        if level not in _LEVELS:
            raise ConfigError(
                f"log_level must be one of {', '.join(_LEVELS)}, not {self.log_level!r}"
            )
        msgspec.structs.force_setattr(self, "log_level", level)
        for name in ("max_job_idle_time", "registration_timeout", "registration_grace"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name} must be > 0 s, not {value!r}")
        for name in ("max_client_mib", "max_total_mib", "max_queue_mib"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a number of MiB > 0, not {value!r}")
        for name in ("max_jobs", "max_jobs_per_client"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)!r}")
        if self.curve_allow is not None and self.curve_secret is None:
            raise ConfigError("curve_allow needs curve_secret (the server's own keys)")
        self.check_scheduler_args(self.scheduler_class())

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PfoSettings:
        """Settings from ``ZEUS_PFO_*`` in ``env`` (default ``os.environ``), then ``overrides``.

        Raises:
            ConfigError: A value that does not parse or validate, naming the variable.
        """
        env = os.environ if env is None else env
        # Variable names are case-insensitive, as with pydantic-settings (zeus_pfo_dump_dir);
        # an exact upper-case name wins over other spellings.
        folded: dict[str, tuple[str, str]] = {}
        for var, raw in env.items():
            upper = var.upper()
            if upper.startswith(ENV_PREFIX) and (upper not in folded or var == upper):
                folded[upper] = (var, raw)
        values: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            found = folded.get(ENV_PREFIX + name.upper())
            if found is None:
                continue
            var, raw = found
            values[name] = parse_setting(var, name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(cls.__struct_fields__)
        if unknown:
            raise ConfigError(f"unknown PFO setting(s): {', '.join(sorted(unknown))}")
        try:
            return msgspec.convert(values, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid PFO settings: {exc}") from None

    def curve_keys(self) -> Any:
        """The server's CURVE keys (:class:`~zeus_async.bus.curve.CurveServerKeys`) or ``None``."""
        if self.curve_secret is None:
            return None
        from ...bus.curve import load_server_keys

        return load_server_keys(self.curve_secret, allowed_clients_dir=self.curve_allow)

    def scheduler_class(self) -> type[FrequencyScheduler]:
        """The scheduler class this setting names (see :func:`.schedulers.scheduler_class`)."""
        return scheduler_class(self.scheduler)

    def check_scheduler_args(self, scheduler: type[FrequencyScheduler]) -> None:
        """Raise ``ConfigError`` unless ``scheduler_args`` fit ``scheduler``'s constructor."""
        signature = inspect.signature(scheduler)
        given = ("job_info", "rank_infos", "pfo_settings")
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        params = [
            p
            for name, p in signature.parameters.items()
            if name not in given and p.kind not in variadic
        ]
        open_ended = any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
        )
        required = [p.name for p in params if p.default is inspect.Parameter.empty]
        missing = [name for name in required if name not in self.scheduler_args]
        if missing:
            example = json.dumps({name: "..." for name in missing})
            raise ConfigError(
                f"the {scheduler.__name__} scheduler needs {', '.join(missing)}: give "
                f"--scheduler-args '{example}' (or ZEUS_PFO_SCHEDULER_ARGS), or choose another "
                "--scheduler"
            )
        known = {p.name for p in params}
        unknown = sorted(set(self.scheduler_args) - known)
        if unknown and not open_ended:
            raise ConfigError(
                f"the {scheduler.__name__} scheduler takes no {', '.join(unknown)} (it takes: "
                f"{', '.join(sorted(known)) or 'nothing'})"
            )
        scheduler.validate_args(**self.scheduler_args)


_FLOATS = (
    "max_job_idle_time", "registration_timeout", "registration_grace", "max_client_mib",
    "max_total_mib", "max_queue_mib",
)  # fmt: skip


def parse_setting(var: str, name: str, raw: str) -> Any:
    if name == "scheduler_args":
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{var} is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{var} must be a JSON object, got {type(value).__name__}")
        return value
    if name == "dump_data":
        low = raw.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"{var} must be true or false, not {raw!r}")
    if name in _FLOATS:
        unit = "MiB" if name.endswith("_mib") else "seconds"
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{var} must be a number of {unit}, not {raw!r}") from None
    if name in ("max_jobs", "max_jobs_per_client"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{var} must be a whole number, not {raw!r}") from None
    return raw
