"""Energy in the training frameworks' own logs.

One module per framework, each importing only its own framework, and only when used:

* :mod:`zeus_async.integrations.hf` — :class:`~.hf.EnergyCallback`, a Hugging Face
  ``transformers.TrainerCallback`` (``Trainer(..., callbacks=[EnergyCallback()])``;
  ``pip install 'zeus_async[hf]'``);
* :mod:`zeus_async.integrations.lightning` — :class:`~.lightning.EnergyCallback`, a PyTorch
  Lightning ``Callback`` (``Trainer(callbacks=[EnergyCallback()])``;
  ``pip install 'zeus_async[lightning]'``).

Both add, at every logging step, the GPU energy since the previous one and its mean power (and
the total so far) to what the framework logs, so TensorBoard, Weights & Biases, MLflow and the
rest receive them with no code; at the end of training, the run's totals. In a job of several
ranks each rank measures its own GPU(s) and the logged figure is the job's (summed over the
ranks). Reading a figure never blocks a step: a logging interval's figure is read when it
ends, exact except for its last ~0.1 s, which is provisional (see
:class:`~zeus_async.aggregate.WindowResult`). The power-limit optimizer's callbacks are in
:mod:`zeus_async.optimizer.integrations`.
"""

from __future__ import annotations

from ._energy_log import EnergyLog

__all__ = ["EnergyLog"]
