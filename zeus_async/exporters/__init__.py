"""Exporters: serve the measurements to monitoring systems.

* :class:`PrometheusExporter` — a runtime consumer and prometheus_client collector keeping the
  latest value of every GPU, RAPL, process and window metric, served over HTTP for scraping
  (imported with prometheus_client on first use).
* :mod:`~zeus_async.exporters.names` — its name sets and default port.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .prometheus import PrometheusExporter as PrometheusExporter

__all__ = ["PrometheusExporter"]

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> Any:
    if name == "PrometheusExporter":
        from .prometheus import PrometheusExporter

        return PrometheusExporter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
