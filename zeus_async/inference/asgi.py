"""ASGI middleware measuring each HTTP request's energy (Starlette, FastAPI, any ASGI app).

::

    from zeus_async.inference import RequestMeter
    from zeus_async.inference.asgi import EnergyMiddleware

    meter = RequestMeter(policy="tokens")
    app = EnergyMiddleware(app, meter, gpus=(0,), delivery=("header", "sse", "usage"))

Each HTTP request is metered from the moment the app is called (or, with
``begin="scheduled"``, from when the app says the request left its queue) to the last byte of
its response; a streaming response (several body messages) marks ``decode`` at its first
chunk. The app reports token counts by setting ``scope["state"]["tokens"] = (tokens_in,
tokens_out)`` (Starlette and FastAPI: ``request.state.tokens = (812, 64)``); without them, an
OpenAI-style ``usage`` object in the response (``prompt_tokens``, ``completion_tokens``) is
used when a delivery reads it. The GPUs default to ``gpus`` and an app may name them per
request in ``scope["state"]["gpus"]``. Every metered response carries ``x-energy-request-id``,
the id the request's figures are settled under (:meth:`RequestMeter.results`, the Prometheus
histograms, the events).

**Delivery** of the figure to the client (``delivery``, any of :data:`DELIVERIES`; the figure
exists only once the request has ended and the GPU's readings cover it, so each waits for it,
at most ``header_wait_s``, asking the meter for a settle in the meter's thread and never
settling on the event loop; past the wait, the figure says ``pending``):

* ``"header"``: a non-streaming response (one body message) is held until its figure is
  known and carries ``x-energy-joules``, ``x-energy-method``, ``x-energy-error-joules`` and,
  with a carbon configuration, ``x-energy-co2e-grams``. A streaming response (several body
  messages) is never held: it passes through at once, its time to first byte unchanged.
* ``"sse"``: a ``text/event-stream`` response passes through at once, except its end: the
  last body message (or the ``data: [DONE]`` event of an OpenAI-style stream) is held, and an
  ``event: energy`` event goes before it, its data the JSON object ``{"request_id",
  "energy_j", "prefill_j", "decode_j", "method", "error_j", "co2e_g" (with a carbon
  configuration), "finish_reason"}`` (``"pending": true`` and null figures past the wait). In
  an OpenAI-style stream the object also has ``"choices": []``, so the OpenAI SDKs, which
  parse every event's data as a chunk, see a chunk without choices (as the ``include_usage``
  chunk); a client that indexes ``choices[0]`` without checking should use ``"usage"``.
* ``"usage"``: a JSON response (one body message) with a top-level ``usage`` object gets
  ``usage.energy_j``, ``usage.energy_method``, ``usage.energy_error_j``,
  ``usage.energy_request_id`` and, with a carbon configuration, ``usage.co2e_g`` (its body is
  held, as with the header); in an event stream, the ``data:`` event whose object carries a
  ``usage`` object (OpenAI's ``stream_options={"include_usage": true}``) is held and gets them.
* ``"trailers"``: where the server supports the ASGI ``http.response.trailers`` extension and
  the client asks for trailers (``TE: trailers``), the response announces them (``trailers``
  in ``http.response.start``, a ``Trailer`` header) and, after its body, an
  ``http.response.trailers`` message carries the header mode's fields.

The request ends at the first of: its last body message, the held ``usage`` event, the held
``[DONE]`` event. ``energy_header=True`` (the older switch) means ``delivery=("header",
"sse")``, and the default is none of them: responses pass through untouched.

**What is metered.** Requests to ``exclude_paths`` (by default the usual metrics and health
paths, :data:`DEFAULT_EXCLUDE`; an entry matches its path and what is under it, and one ending
in ``*`` any path that starts with the rest) are passed to the app untouched and not metered.
A 404 answered without a matched route (no ``scope["route"]`` or ``scope["endpoint"]``: an
unknown path, a scanner, a health check of a path the app lacks) is dropped from the meter
(``RequestMeter.discard`` where the meter has it, else aborted as ``cancelled`` at once, so it
takes almost no energy but is counted; ``meter_unmatched=True`` meters it as any other).

**Begin at scheduling.** With ``begin="scheduled"``, the request begins when the app says it
left its queue: ``scope["state"]["scheduled"]()`` or :func:`mark_scheduled` (``request`` or
scope; ``at_ns=`` for a past instant on the meter's clock), and at its first response message
if the app never says; a request that fails or is cancelled before either is not metered. So
queueing in the handler is not counted as prefill. With ``begin="arrival"`` (the default) the
mark is a no-op, and apps may call it either way.

A request's figures are labelled with its route and model (the Prometheus histograms and CO2e
counters): the route is ``scope["state"]["route"]`` when the app sets it, else the matched
route's template (``scope["route"].path``, set by Starlette and FastAPI), never the raw path;
the model is ``scope["state"]["model"]`` (``request.state.model = "llama-3-8b"``).

A request whose app raised, or answered with a 5xx status, is settled with ``finish_reason``
``error``; one whose client went away (the app cancelled, or returning without its last body
message) ``cancelled``. A stream that fails midway keeps what it already sent (the server then
closes the connection; never a 500 in place of a started response), is settled as ``error``
and, with ``"sse"``, gets its ``event: energy`` (``"finish_reason": "error"``) before the
failure goes on to the server. Whatever the app puts in ``state`` (``tokens = (10, None)``,
GPUs that are not indices), the middleware never raises for it: the meter counts it as bad
input (``totals.bad_input``) and the request is still metered.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping, Sequence
from typing import Any

import anyio

from ..errors import ConfigError
from .meter import RequestMeter

__all__ = ["BEGINS", "DEFAULT_EXCLUDE", "DELIVERIES", "EnergyMiddleware", "mark_scheduled"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: How a request's figure can reach its client (see the module docstring).
DELIVERIES = ("header", "sse", "usage", "trailers")
#: When a request begins: when the app is called, or when the app marks it scheduled.
BEGINS = ("arrival", "scheduled")
#: Paths not metered by default: metrics scrapes and health checks.
DEFAULT_EXCLUDE = (
    "/metrics",
    "/health",
    "/healthz",
    "/livez",
    "/readyz",
    "/ready",
    "/favicon.ico",
)
#: The trailer fields (declared in the ``Trailer`` header).
_TRAILER_NAMES = b"x-energy-joules, x-energy-method, x-energy-error-joules, x-energy-co2e-grams"
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_PENDING = object()


def mark_scheduled(request: Any, at_ns: int | None = None) -> None:
    """Say that ``request`` (a Starlette/FastAPI request, or an ASGI scope) left its queue:
    with ``begin="scheduled"`` its metering begins now (or at ``at_ns``, ns on the meter's
    clock). Does nothing outside the middleware or with ``begin="arrival"``; never raises."""
    try:
        scope = getattr(request, "scope", request)
        mark = scope["state"]["scheduled"]
        mark(at_ns)
    except Exception:
        logger.debug("mark_scheduled: no metered request in %r", type(request).__name__)


class EnergyMiddleware:
    """Meter every HTTP request of ``app`` (see the module docstring).

    Args:
        app: The ASGI application.
        meter: The meter (fed with the runtime's readings elsewhere).
        gpus: The GPUs a request runs on unless the app says otherwise.
        energy_header: The older switch: ``delivery=("header", "sse")``; with ``delivery``
            given too, it adds ``"header"`` to it.
        delivery: How the figure reaches the client: any of :data:`DELIVERIES` (one name,
            or several).
        header_wait_s: Longest wait for a figure; past it the delivery says ``pending``.
        poll_s: How often a held response looks for its figure.
        exclude_paths: Paths not metered (exact, and what is under them; ``"/x*"``: any path
            starting with ``/x``).
        meter_unmatched: Meter 404s answered without a matched route too.
        begin: ``"arrival"`` or ``"scheduled"`` (:data:`BEGINS`).

    Raises:
        ConfigError: An unknown delivery or begin.
    """

    def __init__(
        self,
        app: App,
        meter: RequestMeter,
        *,
        gpus: Sequence[int] = (0,),
        energy_header: bool = False,
        delivery: Collection[str] | None = None,
        header_wait_s: float = 5.0,
        poll_s: float = 0.02,
        exclude_paths: Iterable[str] = DEFAULT_EXCLUDE,
        meter_unmatched: bool = False,
        begin: str = "arrival",
    ) -> None:
        if isinstance(delivery, str):
            delivery = (delivery,)
        modes = set(("header", "sse") if delivery is None and energy_header else delivery or ())
        if energy_header:
            modes.add("header")
        unknown = modes - set(DELIVERIES)
        if unknown:
            raise ConfigError(f"delivery must be among {', '.join(DELIVERIES)}, not {unknown}")
        if begin not in BEGINS:
            raise ConfigError(f"begin must be one of {', '.join(BEGINS)}, not {begin!r}")
        self.app = app
        self.meter = meter
        self.gpus = tuple(gpus)
        self.delivery = frozenset(modes)
        self.energy_header = "header" in modes
        self.header_wait_s = header_wait_s
        self.poll_s = poll_s
        self.meter_unmatched = meter_unmatched
        self.begin = begin
        exact: set[str] = set()
        prefixes: list[str] = []
        for path in exclude_paths:
            if path.endswith("*"):
                prefixes.append(path[:-1])
            else:
                exact.add(path)
                prefixes.append(path.rstrip("/") + "/")
        self._exact = frozenset(exact)
        self._prefixes = tuple(prefixes)
        # The start is held until the first body message only where a body may change.
        self._hold_start = bool(modes & {"header", "usage"})
        self._in_stream = bool(modes & {"sse", "usage"})  # event streams are looked into
        self._at_ns = "at_ns" in inspect.signature(meter.begin).parameters
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{time.time_ns() & 0xFFFFFFFF:x}"

    def excluded(self, scope: Scope) -> bool:
        """Whether the request of ``scope`` is not metered (``exclude_paths``)."""
        path = scope.get("path")
        if type(path) is not str:
            return False
        if path in self._exact or path.startswith(self._prefixes):
            return True
        root = scope.get("root_path")
        if root and type(root) is str and path.startswith(root):
            path = path[len(root) :] or "/"
            return path in self._exact or path.startswith(self._prefixes)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.excluded(scope):
            await self.app(scope, receive, send)
            return
        ex = _Exchange(self, scope, send, f"{self._prefix}-{next(self._ids)}")
        try:
            await self.app(scope, receive, ex.send)
        except anyio.get_cancelled_exc_class():
            ex.finish("cancelled")
            raise
        except OSError:  # the client's connection broke under a send
            ex.finish("cancelled")
            raise
        except Exception:
            ex.finish("error")
            await ex.failed_midway()
            raise
        except BaseException:
            ex.finish("error")
            raise
        # An app that returned without its last body message: the client went away.
        ex.finish("cancelled")

    async def figure(self, rid: str) -> Any:
        """The settled figure of ``rid``, waited for at most ``header_wait_s`` (``None``
        past it): settles run in the meter's thread, never on this loop."""
        deadline = anyio.current_time() + self.header_wait_s
        while True:
            found = self.meter.settled(rid)
            if found is not None:
                return found
            self.meter.settle_soon()  # in the meter's thread, never on this loop
            if anyio.current_time() >= deadline:
                logger.debug("request %s: energy not attributed within %g s", rid,
                             self.header_wait_s)  # fmt: skip
                return None
            await anyio.sleep(self.poll_s)


class _Exchange:
    """One metered request: its edges, and its response on the way to the server."""

    __slots__ = (
        "_figure",
        "app_trailers",
        "begun",
        "chunks",
        "ended",
        "energy_sent",
        "failed",
        "held",
        "json",
        "meter",
        "mw",
        "openai",
        "passthrough",
        "plain",
        "reason",
        "rid",
        "scope",
        "server_send",
        "sse",
        "state",
        "trailers",
        "usage_done",
        "usage_tokens",
    )

    def __init__(self, mw: EnergyMiddleware, scope: Scope, send: Send, rid: str) -> None:
        self.mw = mw
        self.meter = mw.meter
        self.scope = scope
        self.server_send = send
        self.rid = rid
        self.begun = False
        self.ended = False
        self.failed = False  # a 5xx status
        self.held: Message | None = None  # the start, until the first body message
        self.chunks = 0
        self.sse = False  # an event stream whose events may be added to
        self.json = False
        self.trailers = False  # announced by this middleware
        self.app_trailers = False  # announced by the app: ours join its last trailers
        self.energy_sent = False
        self.usage_done = False
        self.openai = False  # a stream ending in data: [DONE]
        self.passthrough = False  # not metered after all (an unmatched 404)
        self.plain = False  # a stream under way whose chunks pass as they are
        self.usage_tokens: tuple[Any, Any] | None = None
        self.reason = ""  # how it ended, here
        self._figure: Any = _PENDING
        state = scope.setdefault("state", {})
        self.state = state
        try:
            state["scheduled"] = self.mark
        except Exception:  # a state that is not a mapping
            pass
        if mw.begin == "arrival":
            self.start_metering()

    # -- edges ------------------------------------------------------------------------------

    def mark(self, at_ns: int | None = None) -> None:
        """The app's ``scope["state"]["scheduled"]``: the request left its queue."""
        if self.mw.begin == "scheduled":
            self.start_metering(at_ns)

    def start_metering(self, at_ns: int | None = None) -> None:
        if self.begun or self.ended:
            return
        self.begun = True
        meter = self.meter
        try:
            gpus = self.state.get("gpus", self.mw.gpus)
        except Exception:  # a state that is not a mapping: the meter checks the GPUs
            gpus = self.mw.gpus
        if at_ns is not None and self.mw._at_ns:
            meter.begin(self.rid, gpus, at_ns=at_ns)
        else:
            meter.begin(self.rid, gpus)

    def finish(self, reason: str) -> None:
        """End the request (once). Never raises: the meter checks the values."""
        if self.ended:
            return
        self.ended = True
        self.reason = reason
        if not self.begun:  # never scheduled, nothing sent: it did not use the GPU
            logger.debug("request %s: %s before it was scheduled, not metered", self.rid, reason)
            return
        state = self.state
        try:
            tokens = state.get("tokens")
            route = state.get("route") or getattr(self.scope.get("route"), "path", "")
            model = state.get("model") or ""
        except Exception:
            tokens, route, model = None, "", ""
        if tokens is None:
            tokens = self.usage_tokens or (0, 0)
        try:
            tokens_in, tokens_out = tokens
        except Exception:
            tokens_in = tokens_out = None  # not a pair: the meter counts both
        if reason == "completed":
            self.meter.end(self.rid, tokens_in=tokens_in, tokens_out=tokens_out, route=route,
                           model=model)  # fmt: skip
        else:
            self.meter.abort(self.rid, reason, tokens_in=tokens_in, tokens_out=tokens_out,
                             route=route, model=model)  # fmt: skip

    def drop(self) -> None:
        """Not metered after all (an unmatched 404): out of the meter."""
        self.passthrough = True
        if self.ended:
            return
        self.ended = True
        if not self.begun:
            return
        discard = getattr(self.meter, "discard", None)
        if discard is not None:
            discard(self.rid)
        else:  # as good as dropped: ended at once, with nothing to attribute to it
            self.meter.abort(self.rid, "cancelled")

    async def figure(self) -> Any:
        if self._figure is _PENDING:
            self._figure = await self.mw.figure(self.rid)
        return self._figure

    # -- the response -----------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        if self.plain and message["type"] == "http.response.body" and message.get("more_body"):
            await self.server_send(message)  # a stream's chunk after its first: as it is
            return
        if self.passthrough:
            await self.server_send(message)
            return
        kind = message["type"]
        if kind == "http.response.start":
            await self._start(message)
        elif kind == "http.response.body":
            await self._body(message)
        elif kind == "http.response.trailers" and self.app_trailers:
            if not message.get("more_trailers", False):
                headers = list(message.get("headers", []))
                headers += _energy_headers(await self.figure())
                message = {**message, "headers": headers}
            await self.server_send(message)
        else:  # http.response.pathsend, zerocopysend (extensions): a body not to be held
            if self.held is not None:
                start, self.held = self.held, None
                await self.server_send(start)
            if kind == "http.response.pathsend" or (
                kind == "http.response.zerocopysend" and not message.get("more_body", False)
            ):
                self.finish("error" if self.failed else "completed")
            await self.server_send(message)

    async def _start(self, message: Message) -> None:
        status = message.get("status", 200)
        scope = self.scope
        if (
            status == 404
            and not self.mw.meter_unmatched
            and scope.get("route") is None
            and scope.get("endpoint") is None
        ):
            self.drop()
            await self.server_send(message)
            return
        self.start_metering()  # begin="scheduled" never marked: at the first response byte
        self.failed = type(status) is int and status >= 500
        headers = list(message.get("headers", []))
        length = False
        for name, value in headers:
            lname = bytes(name).lower()
            if lname == b"content-type":
                ctype = bytes(value).lower()
                self.sse = ctype.startswith(b"text/event-stream")
                self.json = b"json" in ctype
            elif lname == b"content-length":
                length = True
        if length:  # bytes counted in advance: no event may be added
            self.sse = False
        headers.append((b"x-energy-request-id", self.rid.encode()))
        message = {**message, "headers": headers}
        if "trailers" in self.mw.delivery and _trailers_welcome(scope):
            if message.get("trailers"):
                self.app_trailers = True
            else:
                self.trailers = True
                headers.append((b"trailer", _TRAILER_NAMES))
                message["trailers"] = True
        if self.mw._hold_start:
            self.held = message
            return
        await self.server_send(message)

    async def _body(self, message: Message) -> None:
        more = bool(message.get("more_body", False))
        self.chunks += 1
        start = self.held
        if start is not None:
            self.held = None
            if not more and self.chunks == 1:  # not streaming: one body message
                await self._single(start, message)
                return
            await self.server_send(start)
        if self.chunks == 1 and more:
            if self.begun and not self.ended:
                self.meter.phase(self.rid)  # the first chunk of a stream: decoding
            self.plain = not (self.sse and self.mw._in_stream)
        if self.sse and self.mw._in_stream:
            await self._stream_body(message, more)
        else:
            if not more:
                self.finish("error" if self.failed else "completed")
            await self.server_send(message)
        if not more and self.trailers:
            await self._send_trailers()

    async def _single(self, start: Message, message: Message) -> None:
        """A response of one body message: its headers and body may carry the figure."""
        body = bytes(message.get("body", b""))
        delivery = self.mw.delivery
        doc: Any = None
        if "usage" in delivery and self.json and b'"usage"' in body:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                self.usage_tokens = _usage_tokens(doc["usage"])
            else:
                doc = None
        self.finish("error" if self.failed else "completed")
        if "header" in delivery or doc is not None:
            figure = await self.figure()
            headers = list(start.get("headers", []))
            if "header" in delivery:
                headers += _energy_headers(figure)
            if doc is not None:
                _put_usage(doc["usage"], figure, self.rid)
                body = json.dumps(doc, separators=(",", ":")).encode()
                headers = [(k, v) for k, v in headers if bytes(k).lower() != b"content-length"]
                headers.append((b"content-length", str(len(body)).encode()))
                message = {**message, "body": body}
            start = {**start, "headers": headers}
        await self.server_send(start)
        await self.server_send(message)
        if self.trailers:
            await self._send_trailers()

    async def _stream_body(self, message: Message, more: bool) -> None:
        """An event stream's body message: passed on at once, but for its end (the usage
        event, the ``[DONE]`` event, the last message), which waits for the figure."""
        body = bytes(message.get("body", b""))
        delivery = self.mw.delivery
        out = bytearray()
        want_done = "sse" in delivery and not self.energy_sent
        want_usage = "usage" in delivery and not self.usage_done
        if (want_done and b"[DONE]" in body) or (want_usage and _USAGE.search(body)):
            for event in _events(body):
                data = _data_of(event)
                if data is None:
                    out += event
                elif data.strip() == "[DONE]" and "sse" in delivery and not self.energy_sent:
                    self.openai = True
                    await self._flush(out)
                    out += await self._energy_event()
                    out += event
                elif "usage" in delivery and not self.usage_done and '"usage"' in data:
                    out += await self._usage_event(event, data, out)
                else:
                    out += event
            body = bytes(out)
        if not more and "sse" in delivery and not self.energy_sent:
            if body:
                await self.server_send({"type": "http.response.body", "body": body,
                                        "more_body": True})  # fmt: skip
            body = await self._energy_event()
        if not more:
            self.finish("error" if self.failed else "completed")
        await self.server_send({**message, "body": body, "more_body": more})

    async def _flush(self, out: bytearray) -> None:
        if out:
            await self.server_send({"type": "http.response.body", "body": bytes(out),
                                    "more_body": True})  # fmt: skip
            out.clear()

    async def _usage_event(self, event: bytes, data: str, out: bytearray) -> bytes:
        try:
            doc = json.loads(data)
        except ValueError:
            return event
        if not (isinstance(doc, dict) and isinstance(doc.get("usage"), dict)):
            return event
        self.usage_done = True
        self.usage_tokens = _usage_tokens(doc["usage"])
        await self._flush(out)
        self.finish("error" if self.failed else "completed")
        _put_usage(doc["usage"], await self.figure(), self.rid)
        return _with_data(event, json.dumps(doc, separators=(",", ":")))

    async def _energy_event(self) -> bytes:
        """The ``event: energy`` event (the request ends here if it has not)."""
        self.finish("error" if self.failed else "completed")
        self.energy_sent = True
        figure = await self.figure()
        payload: dict[str, Any] = {"request_id": self.rid}
        if figure is None:
            payload.update(energy_j=None, prefill_j=None, decode_j=None, method=None,
                           error_j=None, pending=True)  # fmt: skip
            payload["finish_reason"] = self.reason
        else:
            payload.update(
                energy_j=figure.energy_j,
                prefill_j=figure.prefill_j,
                decode_j=figure.decode_j,
                method=figure.method,
                error_j=getattr(figure, "error_j", None),
            )
            if figure.footprint is not None:
                payload["co2e_g"] = figure.footprint.co2e_g
            payload["finish_reason"] = figure.finish_reason
        if self.openai:
            payload["choices"] = []
        return b"event: energy\ndata: " + json.dumps(payload).encode() + b"\n\n"

    async def _send_trailers(self) -> None:
        headers = _energy_headers(await self.figure())
        await self.server_send({"type": "http.response.trailers", "headers": headers,
                                "more_trailers": False})  # fmt: skip

    async def failed_midway(self) -> None:
        """The app raised: a stream already under way gets its energy event (``error``)
        before the failure goes on to the server (which closes the connection)."""
        if not (self.sse and "sse" in self.mw.delivery and self.chunks and not self.energy_sent):
            return
        if self.held is not None:
            return
        try:
            event = await self._energy_event()
            await self.server_send({"type": "http.response.body", "body": event,
                                    "more_body": True})  # fmt: skip
        except Exception:  # the connection is gone too: the failure goes on as it was
            logger.debug("request %s: no energy event after the failure", self.rid)


def _trailers_welcome(scope: Scope) -> bool:
    """The server supports ASGI trailers and the client asked for them (``TE: trailers``)."""
    extensions = scope.get("extensions") or {}
    if "http.response.trailers" not in extensions:
        return False
    for name, value in scope.get("headers") or ():
        if bytes(name).lower() == b"te" and b"trailers" in bytes(value).lower():
            return True
    return False


def _energy_headers(figure: Any) -> list[tuple[bytes, bytes]]:
    if figure is None:
        return [(b"x-energy-joules", b"pending")]
    headers = [
        (b"x-energy-joules", f"{figure.energy_j:.6g}".encode()),
        (b"x-energy-method", figure.method.encode()),
    ]
    error_j = getattr(figure, "error_j", None)
    if error_j is not None:
        headers.append((b"x-energy-error-joules", f"{error_j:.3g}".encode()))
    if figure.footprint is not None:
        headers.append((b"x-energy-co2e-grams", f"{figure.footprint.co2e_g:.6g}".encode()))
    return headers


def _usage_tokens(usage: dict[str, Any]) -> tuple[Any, Any]:
    return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


def _put_usage(usage: dict[str, Any], figure: Any, rid: str) -> None:
    usage["energy_request_id"] = rid
    if figure is None:
        usage["energy_j"] = None
        usage["energy_pending"] = True
        return
    usage["energy_j"] = figure.energy_j
    usage["energy_method"] = figure.method
    usage["energy_error_j"] = getattr(figure, "error_j", None)
    if figure.footprint is not None:
        usage["co2e_g"] = figure.footprint.co2e_g


def _events(body: bytes) -> list[bytes]:
    """``body`` cut after each event's blank line (the last piece may be unterminated)."""
    out = []
    pos = 0
    for m in _EVENT_END.finditer(body):
        out.append(body[pos : m.end()])
        pos = m.end()
    if pos < len(body):
        out.append(body[pos:])
    return out


def _data_of(event: bytes) -> str | None:
    """The data of one event (its ``data:`` lines joined), ``None`` without any."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")
    ]
    if not lines:
        return None
    try:
        return b"\n".join(lines).decode()
    except UnicodeDecodeError:
        return None


def _with_data(event: bytes, data: str) -> bytes:
    """``event`` with its data lines replaced by one line of ``data``."""
    end = _EVENT_END.search(event)
    sep = event[end.start() : end.end()] if end else b""
    lines = event[: end.start()].splitlines() if end else event.splitlines()
    nl = b"\r\n" if sep == b"\r\n\r\n" else sep[:1] or b"\n"
    kept = [line for line in lines if not line.startswith(b"data:")]
    return nl.join([*kept, b"data: " + data.encode()]) + sep
