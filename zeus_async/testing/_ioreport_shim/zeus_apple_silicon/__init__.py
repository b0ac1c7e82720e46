"""``zeus_apple_silicon`` backed by the zeus_async GPU simulator (put the directory above this
package first on PYTHONPATH)."""

from zeus_async.testing.sim_ioreport import *  # noqa: F403
from zeus_async.testing.sim_ioreport import (  # noqa: F401
    __all__,
    __zeus_async_sim__,
)
