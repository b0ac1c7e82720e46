"""The training frameworks: energy in their own logs, and the power-limit optimizer's callbacks.

One module per framework, holding everything a user of that framework imports, each importing
only its own framework, and only when used:

* :mod:`zeus_async.integrations.hf` — :class:`~.hf.EnergyCallback` and
  :class:`~.hf.HFGlobalPowerLimitOptimizer`, Hugging Face ``TrainerCallback`` classes
  (``Trainer(..., callbacks=[EnergyCallback()])``; ``pip install 'zeus_async[hf]'``);
* :mod:`zeus_async.integrations.lightning` — :class:`~.lightning.EnergyCallback` and
  :class:`~.lightning.LightningPowerLimitOptimizer`, PyTorch Lightning ``Callback`` classes
  (``Trainer(callbacks=[EnergyCallback()])``; ``pip install 'zeus_async[lightning]'``).

Importing this package imports neither framework. What the callbacks of both frameworks
share imports none either: ``_energy_log`` (the energy callbacks) and ``_power_limit`` (the
power-limit callbacks); nothing here imports back from a framework's module.

Both add, at every logging step, the GPU energy since the previous one and its mean power (and
the total so far) to what the framework logs, so TensorBoard, Weights & Biases, MLflow and the
rest receive them with no code; at the end of training, the run's totals. In a job of several
ranks each rank measures its own GPU(s) and the logged figure is the job's (summed over the
ranks). Reading a figure never blocks a step: a logging interval's figure is read when it
ends, exact except for its last ~0.1 s, which is provisional (see
:class:`~zeus_async.aggregate.WindowResult`). The power-limit callbacks were in
``zeus_async.optimizer.hf`` / ``.lightning``, which still give them, with a
``DeprecationWarning``.
"""

from __future__ import annotations

from ._energy_log import EnergyLog

__all__ = ["EnergyLog"]
