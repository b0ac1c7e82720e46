"""Exporters: serve the measurements to monitoring systems.

* :class:`PrometheusExporter` — a runtime consumer and prometheus_client collector keeping the
  latest value of every GPU, RAPL, process and window metric, served over HTTP for scraping.
"""

from __future__ import annotations

import logging

from .prometheus import PrometheusExporter

__all__ = ["PrometheusExporter"]

logger = logging.getLogger(__name__)
