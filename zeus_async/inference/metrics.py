"""Prometheus metrics of request energy: histograms per request and per output token, and the
idle and attributed energy per GPU (prometheus_client).

::

    metrics = RequestMetrics(meter)              # observes every settled request
    app.mount("/metrics", prometheus_client.make_asgi_app(metrics.registry))

Series (base units, as the rest of zeus_async's metrics):

* ``zeus_request_energy_joules`` (histogram, labels ``policy``, ``route``, ``model``):
  energy per request;
* ``zeus_request_energy_per_output_token_joules`` (histogram, the same labels): per generated
  token, for requests that generated any. ``route`` and ``model`` are those the server gives
  (:meth:`RequestMeter.end`; the ASGI middleware gives the matched route's template), ``""``
  when none, bounded as below;
* ``zeus_request_gpu_energy_joules_total{gpu, kind}`` (counter): each GPU's settled energy,
  ``kind="requests"`` or ``"idle"``; their sum is the GPU's measured energy;
* with a meter that has a carbon configuration, ``zeus_request_co2e_grams_total{route, model,
  source}`` and ``zeus_request_energy_cost_total{route, model, source, currency}`` (counters):
  the settled requests' grams CO2e and cost. ``source`` is the configured source's name (one
  value). Routes and models are labels the server gives (:meth:`RequestMeter.end`); the first
  ``max_label_values`` distinct values of each are kept, any later one is counted as
  ``"other"`` (said once in the log), so the series stay bounded;
* ``zeus_request_finished_total{reason}`` (counter): settled requests by finish reason
  (``completed``, ``cancelled``, ``error``, ``unfinished``);
* the meter's backlog, read at each scrape (as of its last settle):
  ``zeus_request_in_flight`` (requests begun, not ended), ``zeus_request_unsettled`` (ended,
  waiting to be settled), ``zeus_request_oldest_age_seconds`` (age of the oldest request in
  flight, 0 without one), ``zeus_request_settle_lag_seconds`` (how far behind the clock the
  settled energy is: results come that late), ``zeus_request_pending_edges`` (edges and
  readings queued for the next settle) and ``zeus_request_bad_input_total{kind}`` (counter:
  the app's bad input by kind, a fixed set, ``RequestMeter``'s ``BAD_INPUT_KINDS``; dropped
  edges are among them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .attribution import Attribution
from .meter import BAD_INPUT_KINDS, FINISH_REASONS, RequestMeter

__all__ = ["ENERGY_BUCKETS", "MAX_LABEL_VALUES", "PER_TOKEN_BUCKETS", "RequestMetrics"]

logger = logging.getLogger(__name__)

#: Joules per request: from a short request on a small GPU to a long generation on a big one.
ENERGY_BUCKETS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)
#: Joules per output token.
PER_TOKEN_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
#: Distinct routes (and models) labelled before the rest are counted as ``"other"``.
MAX_LABEL_VALUES = 32
#: The label of the routes and models beyond ``max_label_values``.
OTHER = "other"


class RequestMetrics:
    """Prometheus series of a meter's settled requests (see the module docstring).

    Args:
        meter: The meter to observe.
        registry: Where the series live (default: a registry of their own).
        buckets, per_token_buckets: Histogram buckets (J).
        max_label_values: Distinct routes, and models, labelled in the histograms and the
            CO2e and cost counters (the rest: ``"other"``).
    """

    def __init__(
        self,
        meter: RequestMeter,
        registry: Any = None,
        *,
        buckets: Sequence[float] = ENERGY_BUCKETS,
        per_token_buckets: Sequence[float] = PER_TOKEN_BUCKETS,
        max_label_values: int = MAX_LABEL_VALUES,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.energy = Histogram(
            "zeus_request_energy_joules",
            "Energy attributed to each inference request",
            ["policy", "route", "model"],
            buckets=tuple(buckets),
            registry=self.registry,
        )
        self.per_token = Histogram(
            "zeus_request_energy_per_output_token_joules",
            "Energy attributed to each inference request per output token",
            ["policy", "route", "model"],
            buckets=tuple(per_token_buckets),
            registry=self.registry,
        )
        self.gpu_energy = Counter(
            "zeus_request_gpu_energy_joules",
            "GPU energy settled by the request meter, to requests or idle",
            ["gpu", "kind"],
            registry=self.registry,
        )
        self.co2e = Counter(
            "zeus_request_co2e_grams",
            "Grams CO2e of the energy attributed to inference requests",
            ["route", "model", "source"],
            registry=self.registry,
        )
        self.cost = Counter(
            "zeus_request_energy_cost",
            "Cost of the energy attributed to inference requests",
            ["route", "model", "source", "currency"],
            registry=self.registry,
        )
        self.finished = Counter(
            "zeus_request_finished",
            "Settled inference requests by finish reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.registry.register(_BacklogCollector(meter))
        self.policy = meter.policy
        self.source = "" if meter.carbon is None else meter.carbon.name
        self._max_labels = max_label_values
        self._seen: dict[str, set[str]] = {"route": set(), "model": set()}
        meter.subscribe(self.observe)

    def _bounded(self, kind: str, value: str) -> str:
        seen = self._seen[kind]
        if value in seen:
            return value
        if len(seen) >= self._max_labels:
            if OTHER not in seen:
                seen.add(OTHER)
                logger.warning(
                    "more than %d request %ss: the rest are counted as %r",
                    self._max_labels,
                    kind,
                    OTHER,
                )
            return OTHER
        seen.add(value)
        return value

    def observe(self, attribution: Attribution) -> None:
        """Take one settled interval (called by the meter)."""
        policy = attribution.policy
        finished = {reason: self.finished.labels(reason) for reason in FINISH_REASONS}
        # (the children of the usual few label sets, looked up once per interval)
        children: dict[tuple[str, str], tuple[Any, Any]] = {}
        for r in attribution.requests.values():
            counter = finished.get(r.finish_reason)
            if counter is not None:
                counter.inc()
            route = self._bounded("route", r.route)
            model = self._bounded("model", r.model)
            pair = children.get((route, model))
            if pair is None:
                pair = children[route, model] = (
                    self.energy.labels(policy, route, model),
                    self.per_token.labels(policy, route, model),
                )
            pair[0].observe(r.energy_j)
            if r.tokens_out:
                pair[1].observe(r.energy_j / r.tokens_out)
            fp = r.footprint
            if fp is None:
                continue
            self.co2e.labels(route, model, self.source).inc(max(fp.co2e_g, 0.0))
            if fp.cost is not None and fp.currency:
                self.cost.labels(route, model, self.source, fp.currency).inc(max(fp.cost, 0.0))
        for gpu, g in attribution.gpus.items():
            self.gpu_energy.labels(str(gpu), "requests").inc(max(g.requests_j, 0.0))
            self.gpu_energy.labels(str(gpu), "idle").inc(max(g.idle_j, 0.0))


class _BacklogCollector:
    """The meter's backlog gauges and bad-input counts, read at each scrape."""

    def __init__(self, meter: RequestMeter) -> None:
        self.meter = meter

    def describe(self) -> list[Any]:
        return list(self._families(None))

    def collect(self) -> list[Any]:
        return list(self._families(self.meter))

    def _families(self, meter: RequestMeter | None) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = None if meter is None else meter.state
        now = 0 if meter is None else meter._clock()

        def gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(name, doc)
            if state is not None:
                family.add_metric([], value)
            return family

        age = lag = 0.0
        if state is not None:
            if state.oldest_begin_ns is not None:
                age = max(0.0, (now - state.oldest_begin_ns) / 1e9)
            if state.settled_ns is not None:
                lag = max(0.0, (now - state.settled_ns) / 1e9)
        bad = CounterMetricFamily(
            "zeus_request_bad_input",
            "Bad input from the app to the request meter, by kind (never an exception)",
            labels=["kind"],
        )
        if meter is not None:
            counts = dict(meter.totals.bad_input)
            for kind in BAD_INPUT_KINDS:
                bad.add_metric([kind], counts.get(kind, 0))
        return [
            gauge(
                "zeus_request_in_flight",
                "Requests begun and not ended",
                0 if state is None else state.in_flight,
            ),
            gauge(
                "zeus_request_unsettled",
                "Requests ended and not settled yet",
                0 if state is None else state.unsettled,
            ),
            gauge("zeus_request_oldest_age_seconds", "Age of the oldest request in flight", age),
            gauge(
                "zeus_request_settle_lag_seconds",
                "How far behind the clock the settled request energy is",
                lag,
            ),
            gauge(
                "zeus_request_pending_edges",
                "Edges and readings queued for the next settle",
                0 if state is None else state.pending,
            ),
            bad,
        ]
