"""A settled request's energy as OpenTelemetry span attributes, beside the ``gen_ai.*`` ones.

::

    from zeus_async.inference.otel import set_energy_attributes

    energy = meter.settled(request_id)          # a RequestEnergy, once settled
    if energy is not None:
        set_energy_attributes(span, energy)

The attributes (:func:`energy_attributes`), all numbers in SI units and present only when
known:

- ``zeus.energy.joules``: the request's energy over all its GPUs;
- ``zeus.energy.prefill_joules``, ``zeus.energy.decode_joules``: of which before and after
  its first token (when the phase was marked);
- ``zeus.energy.error_joules``: the bound on the measurement part of its energy;
- ``zeus.energy.method``: the attribution policy and the estimator's method;
- ``zeus.energy.finish_reason``: ``completed``, ``cancelled``, ``error`` or ``unfinished``;
- ``zeus.energy.gpus``: the GPU indices that served it;
- ``zeus.energy.joules_per_output_token``: when it generated tokens;
- ``zeus.co2e.grams``: its emissions, with a carbon configuration.

Nothing here imports OpenTelemetry: any object with ``set_attribute(key, value)`` will do
(an SDK span, or a non-recording one, where setting is a no-op). A span must still be open to
take attributes; the energy settles after the request ends (one horizon later), so set them on
a span that outlives the request (the server's handler span ended after the settle, or a
child span made for the purpose) rather than on one closed at the last token.
"""

from __future__ import annotations

import logging
from typing import Any, Final, Protocol

from .attribution import RequestEnergy

__all__ = ["ATTRIBUTE_PREFIX", "energy_attributes", "set_energy_attributes"]

logger = logging.getLogger(__name__)

#: Every attribute set here starts with this or ``zeus.co2e.``.
ATTRIBUTE_PREFIX: Final = "zeus.energy."


class _Span(Protocol):
    def set_attribute(self, key: str, value: Any) -> Any:
        """Set one attribute."""


def energy_attributes(energy: RequestEnergy) -> dict[str, Any]:
    """The span attributes of one settled request (see the module docstring)."""
    p = ATTRIBUTE_PREFIX
    out: dict[str, Any] = {
        f"{p}joules": float(energy.energy_j),
        f"{p}method": energy.method,
        f"{p}finish_reason": energy.finish_reason,
        f"{p}gpus": sorted(int(g) for g in energy.gpu_energy_j),
    }
    if energy.prefill_j is not None:
        out[f"{p}prefill_joules"] = float(energy.prefill_j)
    if energy.decode_j is not None:
        out[f"{p}decode_joules"] = float(energy.decode_j)
    error_j = getattr(energy, "error_j", None)
    if error_j is not None:
        out[f"{p}error_joules"] = float(error_j)
    per_token = energy.j_per_output_token
    if per_token is not None:
        out[f"{p}joules_per_output_token"] = float(per_token)
    co2e = energy.co2e_g
    if co2e is not None:
        out["zeus.co2e.grams"] = float(co2e)
    return out


def set_energy_attributes(span: _Span, energy: RequestEnergy) -> None:
    """Set :func:`energy_attributes` on ``span``. Never raises (a tracing failure must not fail
    the request): an error is logged."""
    try:
        for key, value in energy_attributes(energy).items():
            span.set_attribute(key, value)
    except Exception:
        logger.exception("energy attributes not set on the span of %s", energy.request_id)
