"""The exporter's name sets and default port (no import of prometheus_client: the CLI reads
these to build its options)."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_PORT", "NAME_SETS"]

#: The port ``zeus-async exporter`` listens on by default: not dcgm-exporter's 9400, so both
#: can run on one node.
DEFAULT_PORT: Final = 9466
#: Metric name sets: ``native`` (``zeus_gpu_power_watts``...), ``dcgm`` (dcgm-exporter's
#: ``DCGM_FI_DEV_POWER_USAGE``..., units and labels for the GPU series) or ``amd`` (the AMD
#: Device Metrics Exporter's ``gpu_package_power``...); the other series keep their native
#: names.
NAME_SETS: Final = ("native", "dcgm", "amd")
