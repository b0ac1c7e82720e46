"""``.ci/run`` installs vLLM and sets ``ZEUS_ASYNC_REQUIRE_VLLM``: the plugin's tests then
fail when vLLM cannot be imported, instead of skipping (elsewhere they skip)."""

from __future__ import annotations

import importlib
import os

if os.environ.get("ZEUS_ASYNC_REQUIRE_VLLM"):
    for module in ("vllm.v1.metrics.loggers", "vllm.v1.core.sched.scheduler"):
        importlib.import_module(module)  # an ImportError here fails the run, loudly
