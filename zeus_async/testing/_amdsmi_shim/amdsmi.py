"""``amdsmi`` backed by the zeus_async GPU simulator (put this directory first on PYTHONPATH)."""

from zeus_async.testing.sim_amdsmi import *  # noqa: F403
from zeus_async.testing.sim_amdsmi import __zeus_async_sim__  # noqa: F401
