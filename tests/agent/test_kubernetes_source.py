"""The Kubernetes workload source against a real gRPC server on a unix socket that serves
``v1.PodResourcesLister/List`` as the kubelet does (``kubelet_stub.py``).

The server's replies are encoded by hand, field number by field number from the published
``api.proto`` (with fields the source does not define: memory, dynamic resources, packed CPU
ids), so the source's message definitions are checked against the wire format and not against
themselves.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubelet_stub import Kubelet, container_msg, devices_msg, gpu_pod, pod_msg

from zeus_async.agent.kubernetes import KubernetesSource, PodGpus, gpu_ref
from zeus_async.agent.workloads import Workload, WorkloadResolver
from zeus_async.clock import FakeClock
from zeus_async.errors import WorkloadSourceError
from zeus_async.testing.fake_proc import FakeProc

UUIDS = [
    "GPU-00000000-1111-2222-3333-444444444444",
    "GPU-11111111-1111-2222-3333-444444444444",
    "GPU-22222222-1111-2222-3333-444444444444",
    "GPU-33333333-1111-2222-3333-444444444444",
]
S = 1_000_000_000


@pytest.fixture
def sockdir() -> Iterator[Path]:
    # A short path: a unix socket's path must fit in 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="zk8s-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(sockdir: Path) -> Iterator[Kubelet]:
    k = Kubelet(sockdir / "kubelet.sock")
    try:
        yield k
    finally:
        k.stop()


@pytest.fixture
def source(kubelet: Kubelet) -> Iterator[KubernetesSource]:
    with KubernetesSource(kubelet.path) as s:
        yield s


# -- tests ----------------------------------------------------------------------------------------


def test_device_ids() -> None:
    assert gpu_ref("GPU-abc") == "GPU-abc"
    assert gpu_ref("GPU-abc::3") == "GPU-abc"
    assert gpu_ref(" 2 ") == 2
    assert gpu_ref("MIG-5c1e0b6c-2a3e-5b8c-9b1e-7e6a1c2d3e4f") is None
    assert gpu_ref("0000:3b:00.0") is None


def test_list_maps_gpu_devices_to_containers(kubelet: Kubelet, source: KubernetesSource) -> None:
    kubelet.pods = [
        pod_msg(
            "trainer-0",
            "ml",
            [
                container_msg(
                    "main", [devices_msg("nvidia.com/gpu", [UUIDS[0], UUIDS[1]], numa=1)]
                ),
                container_msg("sidecar", []),
            ],
        ),
        pod_msg("nic-pod", "net", [container_msg("c", [devices_msg("example.com/nic", ["eth1"])])]),
        pod_msg(
            "shared",
            "ml",
            [
                container_msg(
                    "a",
                    [
                        devices_msg("nvidia.com/gpu.shared", [f"{UUIDS[2]}::1", f"{UUIDS[2]}::3"]),
                        devices_msg("nvidia.com/mig-1g.10gb", ["MIG-aa"]),
                    ],
                )
            ],
        ),
        pod_msg(
            "by-index", "batch", [container_msg("w", [devices_msg("nvidia.com/gpu", ["3"], None)])]
        ),
        pod_msg("empty", "default", []),
    ]
    assert source.list() == [
        PodGpus(namespace="ml", pod="trainer-0", container="main", gpus=(UUIDS[0], UUIDS[1])),
        PodGpus(namespace="ml", pod="shared", container="a", gpus=(UUIDS[2],)),
        PodGpus(namespace="batch", pod="by-index", container="w", gpus=(3,)),
    ]
    assert kubelet.calls == 1


def test_pods_come_and_go(kubelet: Kubelet, source: KubernetesSource) -> None:
    clock = FakeClock()
    resolver = WorkloadResolver(kubernetes=source, gpu_uuids=UUIDS, expire_s=60, clock=clock)
    assert resolver.for_gpu(0) is None  # nothing read yet

    kubelet.pods = [gpu_pod("a-0", "team", "main", [UUIDS[0], UUIDS[1]])]
    resolver.refresh()
    a = Workload(
        kind="kubernetes",
        key="k8s:team/a-0/main",
        namespace="team",
        pod="a-0",
        container="main",
        started_ns=clock.wall_ns(),
    )
    assert resolver.for_gpu(0) == a
    assert resolver.for_gpu(UUIDS[1]) == a
    assert resolver.for_gpu(UUIDS[1].lower()) == a
    assert resolver.for_gpu(2) is None
    assert resolver.workloads() == [a]

    # a-0 goes, b-0 takes GPU 0 and c-0 GPU 3 by index
    clock.advance_sync(10)
    kubelet.pods = [
        gpu_pod("b-0", "team", "main", [UUIDS[0]]),
        gpu_pod("c-0", "other", "w", ["3"]),
    ]
    resolver.refresh()
    b = Workload(
        kind="kubernetes",
        key="k8s:team/b-0/main",
        namespace="team",
        pod="b-0",
        container="main",
        started_ns=clock.wall_ns(),
    )
    c = Workload(
        kind="kubernetes",
        key="k8s:other/c-0/w",
        namespace="other",
        pod="c-0",
        container="w",
        started_ns=clock.wall_ns(),
    )
    a_ended = Workload(
        kind="kubernetes",
        key="k8s:team/a-0/main",
        namespace="team",
        pod="a-0",
        container="main",
        started_ns=a.started_ns,
        ended_ns=clock.wall_ns(),
    )
    assert resolver.for_gpu(0) == b
    assert resolver.for_gpu(1) is None
    assert resolver.for_gpu(UUIDS[3]) == c
    assert resolver.workloads() == [a_ended, b, c]

    # the ended pod is still known for expire_s, then forgotten
    clock.advance_sync(60)
    kubelet.pods = [gpu_pod("b-0", "team", "main", [UUIDS[0]])]
    resolver.refresh()
    assert [w.key for w in resolver.workloads()] == [a.key, b.key, c.key]
    clock.advance_sync(1)
    resolver.refresh()
    assert [(w.key, w.ended_ns) for w in resolver.workloads()] == [
        (b.key, None),
        (c.key, clock.wall_ns() - S),
    ]
    assert kubelet.calls == 4


def test_process_in_a_pod_follows_its_gpu(
    kubelet: Kubelet, source: KubernetesSource, tmp_path: Path
) -> None:
    """A process in a pod is its user's until the pod list shows which pod holds its GPU."""
    proc = FakeProc(tmp_path / "proc")
    proc.add(
        500,
        uid=0,
        comm="torchrun",
        cgroup=FakeProc.kubepods("8f2b-11", "c0ffee"),
        environ={"NVIDIA_VISIBLE_DEVICES": UUIDS[2]},
    )
    proc.add(501, uid=0, comm="python", cgroup=FakeProc.kubepods("9999-22", "beef"), environ={})
    clock = FakeClock()
    resolver = WorkloadResolver(
        kubernetes=source, gpu_uuids=UUIDS, proc_root=proc.root, expire_s=60, clock=clock
    )
    before = resolver.for_pid(500)
    assert (before.kind, before.key, before.uid, before.user, before.command) == (
        "process",
        "uid:0",
        0,
        "root",
        "torchrun",
    )
    kubelet.pods = [
        gpu_pod("train-7", "ml", "worker", [UUIDS[2]]),
        gpu_pod("serve-1", "web", "srv", [UUIDS[3]]),
    ]
    resolver.refresh()
    assert resolver.for_pid(500) == Workload(
        kind="kubernetes",
        key="k8s:ml/train-7/worker",
        user="root",
        uid=0,
        namespace="ml",
        pod="train-7",
        container="worker",
        command="torchrun",
        started_ns=clock.wall_ns(),
    )
    # no NVIDIA_VISIBLE_DEVICES: matched by the GPU NVML sees it on
    assert resolver.for_pid(501).key == "uid:0"
    assert resolver.for_pid(501, gpus=[3]).key == "k8s:web/serve-1/srv"
    # the user's workload is no longer held by any process: it ends at the next refresh
    resolver.refresh()
    assert {w.key: w.ended_ns is None for w in resolver.workloads()} == {
        "uid:0": False,
        "k8s:ml/train-7/worker": True,
        "k8s:web/serve-1/srv": True,
    }


def test_missing_socket(sockdir: Path) -> None:
    path = sockdir / "kubelet.sock"
    with pytest.raises(WorkloadSourceError) as info:
        KubernetesSource(path).list()
    assert str(info.value) == (
        f"kubelet pod-resources socket {path} not found: not a Kubernetes node, or the kubelet "
        "keeps it elsewhere (give its path)"
    )


def test_not_a_socket(sockdir: Path) -> None:
    path = sockdir / "kubelet.sock"
    path.write_text("")
    with pytest.raises(WorkloadSourceError) as info:
        KubernetesSource(path).list()
    assert str(info.value) == f"kubelet pod-resources socket {path} is not a socket"


def test_nobody_listening(sockdir: Path) -> None:
    path = sockdir / "kubelet.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens: a kubelet that died
    with KubernetesSource(path, timeout_s=5) as source, pytest.raises(WorkloadSourceError) as info:
        source.list()
    message = str(info.value)
    assert message.startswith(f"kubelet pod-resources socket {path}: List failed (UNAVAILABLE: ")
    assert "\n" not in message


def test_no_list_method(sockdir: Path) -> None:
    k = Kubelet(sockdir / "kubelet.sock", serve_list=False)
    try:
        with KubernetesSource(k.path) as source, pytest.raises(WorkloadSourceError) as info:
            source.list()
    finally:
        k.stop()
    assert str(info.value) == (
        f"kubelet pod-resources socket {k.path} does not serve PodResources v1 List (kubelet "
        "older than 1.20?)"
    )


def test_deadline(kubelet: Kubelet) -> None:
    kubelet.hold = threading.Event()  # the kubelet answers only once the test is done
    with (
        KubernetesSource(kubelet.path, timeout_s=0.1) as source,
        pytest.raises(WorkloadSourceError) as info,
    ):
        source.list()
    assert str(info.value) == (
        f"kubelet pod-resources socket {kubelet.path} did not answer List within 0.1 s"
    )


# Everything is imported before the child drops to nobody (who may not read the interpreter's
# own library).
_AS_NOBODY = """
import os, sys
from zeus_async.agent.kubernetes import KubernetesSource
from zeus_async.errors import WorkloadSourceError
source = KubernetesSource(sys.argv[1])
os.setgid(65534); os.setuid(65534)
try:
    source.list()
except WorkloadSourceError as exc:
    print(exc)
"""


def test_no_permission(kubelet: Kubelet, sockdir: Path) -> None:
    """The kernel's check, by a process that is not the socket's owner."""
    os.chmod(kubelet.path, 0o600)
    if os.getuid() == 0:  # drop to nobody in a child: root passes every permission check
        os.chmod(sockdir, 0o755)
        out = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(kubelet.path)],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout.strip()
    else:  # the owner, without the mode bits
        os.chmod(kubelet.path, 0)
        with pytest.raises(WorkloadSourceError) as info:
            KubernetesSource(kubelet.path).list()
        out = str(info.value)
    assert out == (
        f"no permission to connect to the kubelet pod-resources socket {kubelet.path} (it is "
        "root's: run the agent as root)"
    )
    assert kubelet.calls == 0


def test_resolver_keeps_what_it_knew_while_the_kubelet_is_away(
    sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    path = sockdir / "kubelet.sock"
    k = Kubelet(path)
    k.pods = [gpu_pod("a-0", "team", "main", [UUIDS[0]])]
    source = KubernetesSource(path)
    resolver = WorkloadResolver(kubernetes=source, gpu_uuids=UUIDS, expire_s=60, clock=clock)
    try:
        resolver.refresh()
        assert resolver.for_gpu(0) is not None
        k.stop()  # which removes the socket file
        assert not path.exists()
        with caplog.at_level(logging.WARNING, logger="zeus_async.agent.workloads"):
            resolver.refresh()
            resolver.refresh()
        gone = f"kubelet pod-resources socket {path} not found"
        assert [r.getMessage()[: len(gone)] for r in caplog.records] == [gone]  # once
        assert resolver.last_error is not None and resolver.last_error.startswith(gone)
        a = resolver.for_gpu(0)
        assert a is not None and (a.key, a.ended_ns) == ("k8s:team/a-0/main", None)

        caplog.clear()
        k = Kubelet(path)  # the kubelet is back, and a-0 is gone
        with caplog.at_level(logging.WARNING, logger="zeus_async.agent.workloads"):
            resolver.refresh()
        assert [r.getMessage() for r in caplog.records] == ["kubelet pod-resources answers again"]
        assert resolver.last_error is None
        assert resolver.for_gpu(0) is None
    finally:
        source.close()
        k.stop()
