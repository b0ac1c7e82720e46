"""ASGI middleware measuring each HTTP request's energy (Starlette, FastAPI, any ASGI app).

::

    from zeus_async.inference import RequestMeter
    from zeus_async.inference.asgi import EnergyMiddleware

    meter = RequestMeter(policy="tokens")
    app = EnergyMiddleware(app, meter, gpus=(0,), energy_header=True)

Each HTTP request is metered from the moment the app is called to the last byte of its
response; a streaming response (several body messages) marks ``decode`` at its first chunk.
The app reports token counts by setting ``scope["state"]["tokens"] = (tokens_in, tokens_out)``
(Starlette and FastAPI: ``request.state.tokens = (812, 64)``); the GPUs default to ``gpus``
and an app may name them per request in ``scope["state"]["gpus"]``.

With ``energy_header``, the response's headers wait until the request is attributed (at most
``header_wait_s``), then carry ``x-energy-joules`` and ``x-energy-method`` (and, when the meter
has a carbon configuration, ``x-energy-co2e-grams``): the energy is known
only once the request has ended and the GPU's readings cover it, so the response is held back
(its body is buffered) for that long. Without it, responses pass through untouched and every
response carries ``x-energy-request-id``, the id the request's figures are settled under
(:meth:`RequestMeter.results`, the Prometheus histograms, the events).

A request's figures are labelled with its route and model for the Prometheus CO2e counters:
the route is ``scope["state"]["route"]`` when the app sets it, else the matched route's
template (FastAPI's ``scope["route"].path``), never the raw path; the model is
``scope["state"]["model"]`` (``request.state.model = "llama-3-8b"``).

A request whose app raised, or answered with a 5xx status, is settled with ``finish_reason``
``error``; one whose client went away (the app cancelled, or returning without its last body
message) ``cancelled``. Whatever the app puts in ``state`` (``tokens = (10, None)``, GPUs
that are not indices), the middleware never raises for it: the meter counts it as bad input
(``totals.bad_input``) and the request is still metered. The header wait never settles on the
event loop: it asks the meter for a settle in the meter's thread
(:meth:`~.meter.RequestMeter.settle_soon`) and looks for the figure.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import anyio

from .meter import RequestMeter

__all__ = ["EnergyMiddleware"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class EnergyMiddleware:
    """Meter every HTTP request of ``app`` (see the module docstring).

    Args:
        app: The ASGI application.
        meter: The meter (fed with the runtime's readings elsewhere).
        gpus: The GPUs a request runs on unless the app says otherwise.
        energy_header: Hold each response until its energy is attributed and put it in the
            ``x-energy-joules`` header.
        header_wait_s: Longest hold; past it the header says ``pending``.
        poll_s: How often a held response looks for its figure (settling the meter).
    """

    def __init__(
        self,
        app: App,
        meter: RequestMeter,
        *,
        gpus: Sequence[int] = (0,),
        energy_header: bool = False,
        header_wait_s: float = 5.0,
        poll_s: float = 0.02,
    ) -> None:
        self.app = app
        self.meter = meter
        self.gpus = tuple(gpus)
        self.energy_header = energy_header
        self.header_wait_s = header_wait_s
        self.poll_s = poll_s
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{time.time_ns() & 0xFFFFFFFF:x}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"{self._prefix}-{next(self._ids)}"
        state = scope.setdefault("state", {})
        meter = self.meter
        try:
            meter.begin(rid, state.get("gpus", self.gpus))
        except Exception:  # a state that is not a mapping: the meter checks the GPUs
            meter.begin(rid, self.gpus)
        held: list[Message] = []
        chunks = 0
        ended = False
        failed = False  # a 5xx status

        def finish(reason: str) -> None:
            # Never raises: the meter checks the values (counted as bad input there).
            nonlocal ended
            if ended:
                return
            ended = True
            try:
                tokens = state.get("tokens", (0, 0))
                route = state.get("route") or getattr(scope.get("route"), "path", "")
                model = state.get("model") or ""
            except Exception:
                tokens, route, model = (0, 0), "", ""
            try:
                tokens_in, tokens_out = tokens
            except Exception:
                tokens_in = tokens_out = None  # not a pair: the meter counts both
            if reason == "completed":
                meter.end(rid, tokens_in=tokens_in, tokens_out=tokens_out, route=route,
                          model=model)  # fmt: skip
            else:
                meter.abort(rid, reason, tokens_in=tokens_in, tokens_out=tokens_out,
                            route=route, model=model)  # fmt: skip

        async def metered_send(message: Message) -> None:
            nonlocal chunks
            nonlocal failed
            kind = message["type"]
            if kind == "http.response.start":
                status = message.get("status", 200)
                failed = type(status) is int and status >= 500
                headers = list(message.get("headers", []))
                headers.append((b"x-energy-request-id", rid.encode()))
                message = {**message, "headers": headers}
                if self.energy_header:
                    held.append(message)
                    return
            elif kind == "http.response.body":
                more = bool(message.get("more_body", False))
                chunks += 1
                if chunks == 1 and more:
                    self.meter.phase(rid)  # the first chunk of a stream: decoding
                if not more:
                    finish("error" if failed else "completed")
                if self.energy_header:
                    held.append(message)
                    if not more:
                        await self._release(rid, held, send)
                    return
            await send(message)

        try:
            await self.app(scope, receive, metered_send)
        except anyio.get_cancelled_exc_class():
            finish("cancelled")
            raise
        except OSError:  # the client's connection broke under a send
            finish("cancelled")
            raise
        except BaseException:
            finish("error")
            raise
        # An app that returned without its last body message: the client went away.
        finish("cancelled")

    async def _release(self, rid: str, held: list[Message], send: Send) -> None:
        """Send the held response with the request's energy in its headers."""
        figure = await self._figure(rid)
        start = held[0]
        headers = list(start.get("headers", []))
        if figure is None:
            headers.append((b"x-energy-joules", b"pending"))
        else:
            headers.append((b"x-energy-joules", f"{figure.energy_j:.6g}".encode()))
            headers.append((b"x-energy-method", figure.method.encode()))
            if figure.footprint is not None:
                co2e = f"{figure.footprint.co2e_g:.6g}"
                headers.append((b"x-energy-co2e-grams", co2e.encode()))
        body = b"".join(bytes(m.get("body", b"")) for m in held[1:])
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _figure(self, rid: str) -> Any:
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
