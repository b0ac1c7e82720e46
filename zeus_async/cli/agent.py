"""``zeus-async agent``: run the node agent in the foreground (or only restore what dead
processes left changed, with ``--restore``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from ..errors import ZeusAsyncError
from . import processes as _processes
from .common import (
    BACKEND_HELP,
    EXIT_ERROR,
    EXIT_OK,
    CliError,
    add_power_scope_arg,
    backend_arg,
    describe_error,
    nonnegative_float,
    period,
    port_number,
    positive_float,
    service_backend,
)
from .curve import add_server_curve_args, server_curve_from_args

if TYPE_CHECKING:
    from ..agent.leases import Recovery

__all__ = ["SYNC_COMMANDS", "add_parsers"]

logger = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    """Add ``agent`` to the CLI's subparsers."""
    agt = sub.add_parser(
        "agent",
        help="run the node agent (one sampler for every client; restores settings)",
        description="Run the node agent: it samples every GPU once and serves the Monitors, "
        "optimizers and PFO clients of this user on this node, and puts back every power limit "
        "and clock lock a client changed when the client releases it, exits or dies, and when "
        "the agent stops. Its first act is to restore what dead processes left changed.",
    )
    agt.add_argument(
        "--restore",
        action="store_true",
        help="only restore the settings dead processes left changed, then exit",
    )
    agt.add_argument("--backend", type=backend_arg, default="auto", help=BACKEND_HELP)
    add_power_scope_arg(agt)
    agt.add_argument("--period", type=period, default=0.01, help="sampling period (s, >= 0.001)")
    agt.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="adaptive reads (see monitor; default: where the energy counter is expensive)",
    )
    agt.add_argument("--publish", metavar="ENDPOINT", help="also publish on a ZeroMQ endpoint")
    add_server_curve_args(agt)
    agt.add_argument("--record", metavar="FILE", help="also record every event to FILE")
    agt.add_argument("--force", action="store_true", help="overwrite an existing --record file")
    agt.add_argument(
        "--exit-when-idle",
        type=positive_float,
        default=None,
        metavar="S",
        help="stop S seconds after the last client left",
    )
    agt.add_argument(
        "--prometheus-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on PORT (per GPU and per workload; 0: any free port)",
    )
    agt.add_argument(
        "--prometheus-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics are served on (default 127.0.0.1; 0.0.0.0 for every one)",
    )
    agt.add_argument(
        "--host-id",
        default=None,
        metavar="ID",
        help="host id on every event and series (default: the host name)",
    )
    wl = agt.add_argument_group(
        "workloads (docs/workloads.md)",
        "Which Slurm job, pod container or user holds each GPU, and energy per workload.",
    )
    wl.add_argument(
        "--no-workloads",
        action="store_true",
        help="keep no energy per workload (jobs announced by prologs are refused)",
    )
    wl.add_argument(
        "--k8s-socket",
        metavar="PATH",
        default=None,
        help="the kubelet's PodResources socket, for pods "
        "(e.g. /var/lib/kubelet/pod-resources/kubelet.sock)",
    )
    wl.add_argument(
        "--workload-expire",
        type=positive_float,
        default=300.0,
        metavar="S",
        help="how long an ended workload's figures stay exported (default 300 s)",
    )
    req = agt.add_argument_group(
        "inference requests (docs/requests.md, Across processes)",
        "The node's request attributor, for serving processes' RemoteMeters.",
    )
    req.add_argument(
        "--requests-policy",
        choices=("equal", "tokens", "steps"),
        default="equal",
        help="how a GPU's energy is split among the requests in flight (default equal)",
    )
    req.add_argument(
        "--requests-max-age",
        type=positive_float,
        default=600.0,
        metavar="S",
        help="a request in flight longer is settled as unfinished (default 600 s)",
    )
    req.add_argument(
        "--requests-edge-delay",
        type=nonnegative_float,
        default=1.0,
        metavar="S",
        help="how late a request edge may come from a client's batching: the attributor's "
        "horizon stays that far behind now (default 1 s)",
    )
    req.add_argument(
        "--requests-step-base",
        type=nonnegative_float,
        default=None,
        metavar="W",
        help="the steps policy's base power of every GPU, split equally among a step's "
        "requests (default: estimated per GPU from its idle power; 0: all by the weights)",
    )
    procs = agt.add_argument_group(
        "processes (docs/workloads.md)",
        "Per-process CPU, memory and attributed CPU/DRAM/GPU power, each process's figures "
        "labelled with the workload it works for (workload=slurm:4711, uid:1001...).",
    )
    procs.add_argument(
        "--gpu-processes",
        action="store_true",
        help="track every process found on the GPUs",
    )
    procs.add_argument(
        "--pid",
        dest="pids",
        type=_processes._pid,
        action="append",
        default=None,
        metavar="PID",
        help="track this process and its descendants (repeatable)",
    )
    procs.add_argument(
        "--process-period",
        type=positive_float,
        default=1.0,
        metavar="S",
        help="how often processes are sampled (default 1 s)",
    )
    sysg = agt.add_argument_group(
        "system agent (one per node, many users; docs/agent.md)",
        "Run as root: serve every user the policy lets in on a group-owned socket, check each "
        "change against the policy, keep what to restore where only root can write.",
    )
    sysg.add_argument(
        "--system",
        action="store_true",
        help="run the system agent (with --restore: restore what a dead system agent left)",
    )
    sysg.add_argument(
        "--socket",
        metavar="PATH",
        default=None,
        help="its socket (default $ZEUS_ASYNC_SYSTEM_AGENT, else /run/zeus-async/agent.sock)",
    )
    sysg.add_argument(
        "--group",
        metavar="NAME",
        default="zeus-async",
        help="the group whose members may connect (default zeus-async)",
    )
    sysg.add_argument(
        "--policy",
        metavar="FILE",
        default=None,
        help="who may read and change what (TOML; default /etc/zeus-async/policy.toml, the "
        "defaults when it is absent)",
    )
    sysg.add_argument(
        "--state-dir",
        metavar="DIR",
        default=None,
        help="root's directory for its journals and lock (default <socket dir>/state)",
    )


def _agent(args: argparse.Namespace, out: TextIO) -> int:
    """``zeus-async agent``: its own event loop and signal handling (restores come first)."""
    from ..agent.client import node_agent_config
    from ..agent.leases import recover_orphans
    from ..agent.server import EXIT_AGENT_RUNNING, serve

    try:
        system = _system_options(args)
        if args.restore:
            if system:
                from ..agent.journal import journal_dir
                from ..agent.server import enter_system_dirs

                cfg = node_agent_config(**system)
                return _restore(recover_orphans(journal_dir(enter_system_dirs(cfg))), out)
            return _restore(recover_orphans(), out)
        cfg = node_agent_config(
            backend=args.backend,
            period_s=args.period,
            adaptive_reads=args.adaptive,
            power_scope=args.power_scope,
            publish=args.publish,
            record=args.record,
            overwrite=args.force,
            exit_when_idle_s=args.exit_when_idle,
            publish_curve_secret=args.curve_secret,
            publish_curve_allow=args.curve_allow,
            prometheus_port=args.prometheus_port,
            prometheus_addr=args.prometheus_addr,
            host=args.host_id,
            workloads=not args.no_workloads,
            k8s_socket=args.k8s_socket,
            workload_expire_s=args.workload_expire,
            requests_policy=args.requests_policy,
            requests_max_age_s=args.requests_max_age,
            requests_edge_delay_s=args.requests_edge_delay,
            requests_step_base_w=args.requests_step_base,
            processes=_processes.tracking_from_args(args, None),
            **system,
        )
        server_curve_from_args(args, "--publish", args.publish)  # checked before serving
        if args.record is not None:
            from ..store.outputs import claim_output

            claim_output(args.record, overwrite=args.force, what="recording", recording=True)
        # Last: the options are checked first, whatever the machine.
        cfg = msgspec.structs.replace(
            cfg, backend=service_backend(args.backend, "zeus-async agent")
        )
    except (ZeusAsyncError, CliError, OSError) as exc:
        sys.stderr.write(f"zeus-async agent: {describe_error(exc)}\n")
        return EXIT_ERROR
    code = serve(cfg, ready_line=True)
    if code == EXIT_AGENT_RUNNING:
        sys.stderr.write("zeus-async agent: another agent is already running on this node\n")
        return EXIT_ERROR
    if code > 128:  # stopped by a signal, everything restored: 130 after Ctrl-C
        return code
    return EXIT_OK if code == 0 else EXIT_ERROR


def _system_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--system`` and its options as agent settings (empty without ``--system``), checked:
    root, and (unless only restoring) the group exists and the policy reads.

    Raises:
        CliError: A system option without ``--system``.
        ConfigError: Not root, or no such group; PolicyError: a bad policy file.
    """
    given = [
        flag
        for flag, value in (
            ("--socket", args.socket),
            ("--policy", args.policy),
            ("--state-dir", args.state_dir),
            ("--group", None if args.group == "zeus-async" else args.group),
        )
        if value is not None
    ]
    if not args.system:
        if given:
            raise CliError(f"{given[0]} needs --system")
        return {}
    from ..agent.policy import load_policy
    from ..agent.system import group_id, require_root, system_socket

    require_root()
    if not args.restore:
        group_id(args.group)
        load_policy(args.policy, group=args.group)
    sock = Path(args.socket) if args.socket else system_socket()
    return {
        "endpoint": f"ipc://{sock.absolute()}",
        "system": True,
        "system_group": args.group,
        "policy": args.policy,
        "state_dir": args.state_dir,
    }


def _restore(recovery: Recovery, out: TextIO) -> int:
    """``--restore``'s report: each setting restored or not, each that a damaged journal lost,
    each damaged journal kept; nonzero unless everything dead processes changed is back."""
    for r in recovery.restored:
        out.write(f"{r.describe()}\n")
    for lost in recovery.lost:
        out.write(f"NOT RECOVERED: {lost.describe()}\n")
    for path in recovery.kept:
        out.write(f"damaged journal kept as {path}\n")
    done = len(recovery.restored) - len(recovery.failed)
    out.write(f"{len(recovery.restored)} setting(s) found to restore, {done} restored")
    if recovery.lost:
        out.write(f"; {len(recovery.lost)} could not be recovered from damaged journals")
    out.write("\n")
    return EXIT_OK if recovery.complete else EXIT_ERROR


# -- entry point --------------------------------------------------------------------------------


#: Exit status after the output pipe closed (128 + SIGPIPE, what a shell shows for `head`).


#: Commands that run their own event loop: ``(args, out) -> exit status``.
SYNC_COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {"agent": _agent}
