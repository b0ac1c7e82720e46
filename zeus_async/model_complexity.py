"""Model complexity: parameter count and FLOPs/MACs of one forward pass of a torch model.

FLOPs come from torch's own counter (:class:`torch.utils.flop_counter.FlopCounterMode`), which
counts matrix multiplications, convolutions and attention (2 FLOPs per multiply-accumulate);
element-wise operations are not counted, as in most published model FLOP figures. MACs are
FLOPs / 2. No dependency beyond torch; torch is imported only when this is called.

The figures go into the run metadata (``Monitor(model=..., input_size=...)``, the recording
header's ``meta``) under the keys of :meth:`ModelComplexity.as_meta`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from .errors import ConfigError

__all__ = ["ModelComplexity", "model_complexity"]

logger = logging.getLogger(__name__)


class ModelComplexity(msgspec.Struct, frozen=True):
    """What :func:`model_complexity` measured.

    Attributes:
        params: Number of parameters.
        trainable_params: Parameters with ``requires_grad``.
        flops: Floating-point operations of one forward pass on an input of ``input_size``.
        macs: Multiply-accumulate operations (``flops / 2``).
        input_size: The input shape used, batch dimension first.
        flops_by_operator: FLOPs per torch operator (``aten.mm``, ``aten.convolution``, ...).
    """

    params: int
    trainable_params: int
    flops: int
    macs: int
    input_size: tuple[int, ...]
    flops_by_operator: dict[str, int] = msgspec.field(default_factory=dict)

    def as_meta(self) -> dict[str, str]:
        """String metadata for a recording header (``model.params``, ``model.flops``, ...)."""
        return {
            "model.params": str(self.params),
            "model.trainable_params": str(self.trainable_params),
            "model.flops": str(self.flops),
            "model.macs": str(self.macs),
            "model.input_size": "x".join(str(d) for d in self.input_size),
        }


def model_complexity(
    model: Any,
    input_size: Sequence[int],
    *,
    dtype: Any = None,
    device: Any = None,
) -> ModelComplexity:
    """Count the parameters and the FLOPs/MACs of ``model`` on a random input.

    Args:
        model: A ``torch.nn.Module``.
        input_size: Input shape including the batch dimension, e.g. ``(1, 3, 224, 224)``.
        dtype: Input dtype (default ``torch.float32``).
        device: Where the input is made (default: the device of the model's first parameter).

    The forward pass runs under ``torch.no_grad()`` in eval mode (the model's mode is restored),
    so it does not change the model.

    Raises:
        ImportError: torch is not installed.
        ConfigError: ``model`` is not a torch module, or ``input_size`` is not a shape.
    """
    try:
        import torch
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError as exc:
        raise ImportError(
            f"model complexity needs torch (pip install 'zeus_async[torch]'): {exc}"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    shape = tuple(input_size)
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ConfigError(f"input_size must be a shape of positive ints, got {input_size!r}")
    params = list(model.parameters())
    if device is None:
        device = params[0].device if params else "cpu"
    example = torch.randn(shape, dtype=dtype or torch.float32, device=device)
    was_training = model.training
    counter = FlopCounterMode(display=False)
    try:
        model.eval()
        with torch.no_grad(), counter:
            model(example)
    finally:
        model.train(was_training)
    flops = int(counter.get_total_flops())
    # Per module (nested) plus "Global", the whole pass.
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    result = ModelComplexity(
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        flops=flops,
        macs=flops // 2,
        input_size=shape,
        flops_by_operator=by_op,
    )
    logger.info(
        "model: %d parameters, %.3g FLOPs per forward pass on %s",
        result.params,
        result.flops,
        shape,
    )
    return result
