"""Test helpers that users can use too.

* :mod:`zeus_async.testing.sim_pynvml` — the GPU simulator behind the ``pynvml`` API;
* :mod:`zeus_async.testing.fakes` — scripted devices for runtime tests;
* :mod:`zeus_async.testing.fake_sysfs` — a fake RAPL powercap tree.
"""
