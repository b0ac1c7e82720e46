"""The workload ledger: each GPU's counter steps credited to the GPU's holder, counters that
never go down (across an agent restart too), and a bounded set of workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeus_async.agent.ledger import WorkloadLedger
from zeus_async.agent.slurm import SlurmSource
from zeus_async.agent.workloads import WorkloadResolver
from zeus_async.clock import FakeClock
from zeus_async.events import GpuSample, WorkloadChange, WorkloadEnergy

S = 1_000_000_000


def _resolver(tmp_path: Path, clock: FakeClock, expire_s: float = 60.0) -> WorkloadResolver:
    (tmp_path / "proc").mkdir(exist_ok=True)
    slurm = SlurmSource(proc_root=tmp_path / "proc")
    return WorkloadResolver(slurm=slurm, expire_s=expire_s, clock=clock)


def _sample(gpu: int, t_s: float, counter_j: float) -> GpuSample:
    return GpuSample(host="n1", t_ns=round(t_s * S), gpu=gpu, energy_j=counter_j)


def _feed(ledger: WorkloadLedger, gpu: int, t0_ms: int, t1_ms: int, watts: float) -> None:
    """Samples every 10 ms of a GPU drawing ``watts``, its counter updated every 100 ms."""
    for ms in range(t0_ms, t1_ms, 10):
        ledger.add([_sample(gpu, ms / 1000, watts * (ms // 100) / 10)])


def test_counter_steps_go_to_the_holder_of_each_gpu_at_that_moment(tmp_path: Path) -> None:
    clock = FakeClock()
    resolver = _resolver(tmp_path, clock)
    slurm = resolver.slurm
    assert slurm is not None
    ledger = WorkloadLedger(resolver, host="n1", clock=clock)
    _feed(ledger, 0, 0, 250, 100.0)
    _feed(ledger, 1, 0, 250, 300.0)
    slurm.register(4711, gpus=[0], user="root", uid=0)  # at 0.25 s: inside a counter period
    _feed(ledger, 0, 250, 750, 100.0)
    _feed(ledger, 1, 250, 750, 300.0)  # nobody's
    slurm.register(4712, gpus=[1], user="root", uid=0)  # at 0.75 s
    slurm.unregister(4711)
    _feed(ledger, 0, 750, 1010, 100.0)
    _feed(ledger, 1, 750, 1010, 300.0)
    # GPU 0 from 0.25 s to 0.75 s at 100 W: the periods cut by the changes shared by time.
    assert ledger.energy("slurm:4711") == {0: pytest.approx(50.0)}
    assert ledger.energy("slurm:4712") == {1: pytest.approx(300.0 * 0.25)}  # to the 1.0 s update
    out = ledger.events()
    changes = {e.key: e for e in out if isinstance(e, WorkloadChange)}
    energies = {e.key: e.gpu_energy_j for e in out if isinstance(e, WorkloadEnergy)}
    assert changes["slurm:4712"].state == "started" and changes["slurm:4712"].gpus == [1]
    assert changes["slurm:4712"].user == "root" and changes["slurm:4712"].uid == 0
    assert set(energies) == {"slurm:4711", "slurm:4712"}
    # Announced once: a second call sends only the counters.
    assert all(isinstance(e, WorkloadEnergy) for e in ledger.events())


def test_a_counter_that_goes_backwards_credits_nothing_for_that_step(tmp_path: Path) -> None:
    clock = FakeClock()
    resolver = _resolver(tmp_path, clock)
    assert resolver.slurm is not None
    resolver.slurm.register(7, gpus=[0], user="root", uid=0)
    ledger = WorkloadLedger(resolver, host="n1", clock=clock)
    ledger.add([_sample(0, t, c) for t, c in ((0, 100.0), (1, 150.0), (2, 3.0), (3, 13.0))])
    assert ledger.energy("slurm:7") == {0: 60.0}


def test_the_counters_go_on_across_an_agent_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    state = tmp_path / "ledger.json"
    resolver = _resolver(tmp_path, clock)
    assert resolver.slurm is not None
    resolver.slurm.register(4711, gpus=[0, 1], user="root", uid=0)
    ledger = WorkloadLedger(resolver, host="n1", state_path=state, clock=clock)
    ledger.add([_sample(0, 0, 0.0), _sample(1, 0, 0.0), _sample(0, 1, 300.0), _sample(1, 1, 200.0)])
    ledger.events()
    ledger.save()
    # The agent dies; the job goes on and the driver's counters keep counting. A new agent
    # (a new resolver: the prolog's registration comes back from the ledger's file).
    again = WorkloadLedger(_resolver(tmp_path, clock), host="n1", state_path=state, clock=clock)
    assert again.energy("slurm:4711") == {0: 300.0, 1: 200.0}
    again.add([_sample(0, 9, 1200.0), _sample(1, 9, 900.0), _sample(0, 10, 1300.0)])
    assert again.energy("slurm:4711") == {0: 1300.0, 1: 900.0}
    energies = [e for e in again.events() if isinstance(e, WorkloadEnergy)]
    assert energies[0].gpu_energy_j == {0: 1300.0, 1: 900.0}


def test_energy_drawn_while_down_is_not_credited_when_the_holder_changed(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    state = tmp_path / "ledger.json"
    resolver = _resolver(tmp_path, clock)
    assert resolver.slurm is not None
    resolver.slurm.register(1, gpus=[0], user="root", uid=0)
    ledger = WorkloadLedger(resolver, host="n1", state_path=state, clock=clock)
    ledger.add([_sample(0, 0, 0.0), _sample(0, 1, 100.0)])
    ledger.save()
    again = WorkloadLedger(_resolver(tmp_path, clock), host="n1", state_path=state, clock=clock)
    slurm = again.resolver.slurm
    assert slurm is not None
    slurm.unregister(1)
    slurm.register(2, gpus=[0], user="root", uid=0)
    again.add([_sample(0, 5, 600.0), _sample(0, 6, 650.0)])
    assert again.energy("slurm:1") == {0: 100.0}
    assert again.energy("slurm:2") == {0: 50.0}


def test_ended_workloads_expire_and_the_set_stays_bounded(tmp_path: Path) -> None:
    clock = FakeClock()
    resolver = _resolver(tmp_path, clock, expire_s=10.0)
    slurm = resolver.slurm
    assert slurm is not None
    ledger = WorkloadLedger(resolver, host="n1", clock=clock)
    counter = 0.0
    most = 0
    expired = 0
    for job in range(1, 1001):
        slurm.register(job, gpus=[0], user="root", uid=0)
        for _ in range(3):
            counter += 10.0
            ledger.add([_sample(0, clock.wall_ns() / S, counter)])
            clock.advance_sync(1.0)
        slurm.unregister(job)
        resolver.refresh()
        out = ledger.events()
        expired += sum(isinstance(e, WorkloadChange) and e.state == "expired" for e in out)
        most = max(most, len({e.key for e in out if isinstance(e, WorkloadEnergy)}))
    assert most <= 5  # jobs of the last 10 s (3 s each) and the one running
    assert len(ledger.totals) == most
    clock.advance_sync(60.0)
    resolver.refresh()
    out = ledger.events()
    assert [e for e in out if isinstance(e, WorkloadEnergy)] == []
    assert (
        expired + sum(isinstance(e, WorkloadChange) and e.state == "expired" for e in out) == 1000
    )
    assert ledger.totals == {}


def test_a_damaged_ledger_file_starts_from_zero_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "ledger.json"
    state.write_text("{not json")
    clock = FakeClock()
    ledger = WorkloadLedger(_resolver(tmp_path, clock), host="n1", state_path=state, clock=clock)
    assert ledger.totals == {}
    assert "unreadable" in caplog.text


def test_prometheus_exports_the_counters_with_the_workloads_labels_until_they_expire(
    tmp_path: Path,
) -> None:
    from zeus_async.exporters.prometheus import PrometheusExporter

    clock = FakeClock()
    resolver = _resolver(tmp_path, clock, expire_s=5.0)
    slurm = resolver.slurm
    assert slurm is not None
    ledger = WorkloadLedger(resolver, host="n1", clock=clock)
    exporter = PrometheusExporter()
    slurm.register(4711, gpus=[0, 1], user="root", uid=0, partition="gpu")
    ledger.add([_sample(0, 0, 10.0), _sample(1, 0, 20.0), _sample(0, 1, 110.0)])
    ledger.add([_sample(1, 1, 70.0)])
    exporter.add(ledger.events())
    text = exporter.render().decode()
    lines = sorted(ln for ln in text.splitlines() if ln.startswith("zeus_workload_gpu_energy"))
    assert lines == [
        'zeus_workload_gpu_energy_joules_total{gpu="0",host="n1",job_id="4711",kind="slurm",'
        'partition="gpu",user="root",workload="slurm:4711"} 100.0',
        'zeus_workload_gpu_energy_joules_total{gpu="1",host="n1",job_id="4711",kind="slurm",'
        'partition="gpu",user="root",workload="slurm:4711"} 50.0',
    ]
    slurm.unregister(4711)
    resolver.refresh()
    exporter.add(ledger.events())  # ended: still exported
    assert "zeus_workload_gpu_energy_joules_total{" in exporter.render().decode()
    clock.advance_sync(6.0)
    resolver.refresh()
    exporter.add(ledger.events())  # expired: gone
    assert "zeus_workload_gpu_energy_joules_total{" not in exporter.render().decode()
    exporter.close()
