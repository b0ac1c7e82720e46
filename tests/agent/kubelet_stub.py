"""A kubelet's PodResources endpoint for tests: a real gRPC server on a unix socket serving
``v1.PodResourcesLister/List`` as the kubelet does, with replies encoded by hand.

The replies are encoded field number by field number from the published ``api.proto``
(kubernetes/kubelet ``pkg/apis/podresources/v1/api.proto``), with fields the source does not
define (memory, dynamic resources, packed CPU ids), so the source's message definitions are
checked against the wire format and not against themselves.

Used by ``test_kubernetes_source.py`` (the source alone) and ``test_kubernetes_agent.py`` (a
real node agent reading it).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

__all__ = [
    "Kubelet",
    "container_msg",
    "devices_msg",
    "gpu_pod",
    "pod_msg",
    "response_msg",
]

# -- the wire format, by hand -----------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _str(field: int, text: str) -> bytes:
    return _len(field, text.encode())


def devices_msg(resource: str, ids: list[str], numa: int | None = 0) -> bytes:
    """``ContainerDevices{resource_name=1, device_ids=2, topology=3{nodes=1{ID=1}}}``."""
    out = _str(1, resource) + b"".join(_str(2, i) for i in ids)
    if numa is not None:
        out += _len(3, _len(1, _varint(1 << 3 | 0) + _varint(numa)))
    return out


def container_msg(name: str, devices: list[bytes], cpus: tuple[int, ...] = (2, 3)) -> bytes:
    """``ContainerResources{name=1, devices=2, cpu_ids=3 (packed), memory=4,
    dynamic_resources=5}``."""
    out = _str(1, name) + b"".join(_len(2, d) for d in devices)
    out += _len(3, b"".join(_varint(c) for c in cpus))
    out += _len(4, _str(1, "memory") + _varint(2 << 3 | 0) + _varint(1 << 30))
    out += _len(5, _str(1, "gpu.example.com") + _str(2, "claim-1") + _str(3, "default"))
    return out


def pod_msg(name: str, namespace: str, containers: list[bytes]) -> bytes:
    """``PodResources{name=1, namespace=2, containers=3}``."""
    return _str(1, name) + _str(2, namespace) + b"".join(_len(3, c) for c in containers)


def response_msg(pods: list[bytes]) -> bytes:
    """``ListPodResourcesResponse{pod_resources=1}``."""
    return b"".join(_len(1, p) for p in pods)


def gpu_pod(name: str, namespace: str, container: str, ids: list[str]) -> bytes:
    """A pod of one container holding ``nvidia.com/gpu`` devices ``ids``."""
    return pod_msg(
        name, namespace, [container_msg(container, [devices_msg("nvidia.com/gpu", ids)])]
    )


# -- a kubelet ----------------------------------------------------------------------------------


class Kubelet:
    """A gRPC server on a unix socket serving PodResourcesLister.List with ``pods``.

    ``pods`` (served from the start) may be replaced at any time, from another thread too:
    :meth:`serve` does it atomically with respect to ``List`` and says how many calls came
    before, so that :meth:`wait_calls` can wait for a reader's next calls instead of sleeping.
    ``call_ns`` holds the wall time of each ``List``. :meth:`stop` removes the socket file, as
    a kubelet that exits does.
    """

    def __init__(
        self, path: Path, *, serve_list: bool = True, pods: list[bytes] | None = None
    ) -> None:
        self.path = path
        self.pods: list[bytes] = list(pods or [])
        self.calls = 0
        self.call_ns: list[int] = []
        self.hold: threading.Event | None = None
        self._called = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        if serve_list:
            handler = grpc.unary_unary_rpc_method_handler(self._list)  # raw bytes both ways
            self.server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("v1.PodResourcesLister", {"List": handler}),)
            )
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def _list(self, request: bytes, context: Any) -> bytes:
        assert request == b""  # ListPodResourcesRequest{}
        with self._called:
            self.calls += 1
            self.call_ns.append(time.time_ns())
            pods = self.pods
            self._called.notify_all()
        if self.hold is not None:
            self.hold.wait(10)
        return response_msg(pods)

    def serve(self, pods: list[bytes]) -> tuple[int, int]:
        """Answer every later ``List`` with ``pods``; the wall time of the change and the
        number of calls answered before it."""
        with self._called:
            self.pods = list(pods)
            return time.time_ns(), self.calls

    def wait_calls(self, n: int, timeout: float = 10.0) -> None:
        """Block until ``List`` has been answered ``n`` times in all.

        Raises:
            TimeoutError: Not within ``timeout`` seconds.
        """
        with self._called:
            if not self._called.wait_for(lambda: self.calls >= n, timeout):
                raise TimeoutError(f"{self.calls} List calls, not {n}, in {timeout:g} s")

    def stop(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self.server.stop(None).wait()
