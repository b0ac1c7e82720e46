"""``pynvml`` backed by the zeus_async GPU simulator (put this directory first on PYTHONPATH)."""

from zeus_async.testing.sim_pynvml import *  # noqa: F403
from zeus_async.testing.sim_pynvml import (  # noqa: F401
    __all__,
    __getattr__,
    __zeus_async_sim__,
    _nvmlGetFunctionPointer,
)
