"""The ``vendor`` fixture: each GPU vendor on its simulator (see ``vendor_cases.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from vendor_cases import CASES, PENDING, VENDORS, VendorCase, not_ready


@pytest.fixture(params=VENDORS)
def vendor(request: pytest.FixtureRequest) -> VendorCase:
    """Each vendor on its simulator (see the module's docstring)."""
    name = str(request.param)
    if name in PENDING:
        reason = not_ready(name)
        if reason is not None:
            pytest.skip(reason)
    return CASES[name]


@pytest.fixture(autouse=True)
def _uninstall_simulators() -> Iterator[None]:
    """Each test starts and ends with no simulated API serving a node."""
    from zeus_async.testing import sim_amdsmi, sim_ioreport, sim_jetson, sim_pynvml

    yield
    for module in (sim_pynvml, sim_amdsmi, sim_jetson, sim_ioreport):
        module.uninstall()
