"""Kubernetes as a source of workload identity: which pod and container holds each GPU,
from the kubelet's PodResources API (v1, ``List``).

The kubelet serves ``podresources.v1.PodResourcesLister`` on a unix socket
(``/var/lib/kubelet/pod-resources/kubelet.sock`` by default; root's). ``List`` returns every
pod on the node with, per container, the devices its device plugins allocated: for the NVIDIA
device plugin, resource ``nvidia.com/gpu`` with the GPUs' UUIDs (``GPU-8932f937-...``, the
default ``deviceIDStrategy``), or their indices (``deviceIDStrategy: index``). A GPU shared by
time-slicing is listed as ``GPU-...::<replica>``, and counts as the GPU. MIG slices
(``MIG-...``) are left out: the agent samples whole GPUs.

The messages are defined here from the published ``api.proto`` (kubernetes/kubelet,
``pkg/apis/podresources/v1/api.proto``) as a ``FileDescriptorProto`` built at first use into a
private descriptor pool, and read with protobuf's runtime: no generated code, no ``protoc``
step, and no clash with another library's ``v1`` messages. Only the fields read here are
defined; the others (memory, dynamic resources) are skipped as unknown fields, as protobuf
does for any field a reader does not know.

grpcio and protobuf come with the ``k8s`` extra (``pip install zeus_async[k8s]``).
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec

from ..errors import ConfigError, WorkloadSourceError

__all__ = [
    "DEFAULT_SOCKET",
    "GPU_RESOURCES",
    "LIST_METHOD",
    "KubernetesSource",
    "PodGpus",
    "gpu_ref",
    "podresources_messages",
]

logger = logging.getLogger(__name__)

#: Where the kubelet serves the PodResources API.
DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
#: Device-plugin resources that are whole NVIDIA GPUs (``.shared``: time-slicing renamed).
GPU_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared")
#: The gRPC method called.
LIST_METHOD = "/v1.PodResourcesLister/List"


class PodGpus(msgspec.Struct, frozen=True, kw_only=True):
    """The GPUs one container of one pod holds.

    Attributes:
        namespace: The pod's namespace.
        pod: The pod's name.
        container: The container's name.
        gpus: Its GPUs: NVML indices or ``GPU-...`` UUIDs (time-slicing replicas folded).
    """

    namespace: str
    pod: str
    container: str
    gpus: tuple[int | str, ...]


def gpu_ref(device_id: str) -> int | str | None:
    """The GPU a device plugin's device ID names: ``"GPU-abc"`` and ``"GPU-abc::2"`` (a
    time-slicing replica) give ``"GPU-abc"``, ``"3"`` gives ``3``; a MIG slice or anything
    else gives ``None``."""
    entry = device_id.strip().split("::", 1)[0]
    if entry.isdigit():
        return int(entry)
    if entry.upper().startswith("GPU-"):
        return entry
    return None


def _field(
    name: str, number: int, kind: str, *, repeated: bool = False, type_name: str = ""
) -> Any:
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FieldDescriptorProto
    out = fdp(
        name=name,
        number=number,
        type=getattr(fdp, kind),
        label=fdp.LABEL_REPEATED if repeated else fdp.LABEL_OPTIONAL,
    )
    if type_name:
        out.type_name = type_name
    return out


@functools.cache
def podresources_messages() -> dict[str, Any]:
    """The PodResources v1 message classes by name (``ListPodResourcesRequest``,
    ``ListPodResourcesResponse``, ``PodResources``, ``ContainerResources``,
    ``ContainerDevices``, ``TopologyInfo``, ``NUMANode``), built once.

    Raises:
        ConfigError: protobuf is not installed.
    """
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError as exc:
        raise ConfigError(
            "the Kubernetes source needs grpcio and protobuf: pip install 'zeus_async[k8s]'"
        ) from exc
    messages: dict[str, list[Any]] = {
        "ListPodResourcesRequest": [],
        "ListPodResourcesResponse": [
            _field("pod_resources", 1, "TYPE_MESSAGE", repeated=True, type_name=".v1.PodResources")
        ],
        "PodResources": [
            _field("name", 1, "TYPE_STRING"),
            _field("namespace", 2, "TYPE_STRING"),
            _field(
                "containers", 3, "TYPE_MESSAGE", repeated=True, type_name=".v1.ContainerResources"
            ),
        ],
        "ContainerResources": [
            _field("name", 1, "TYPE_STRING"),
            _field("devices", 2, "TYPE_MESSAGE", repeated=True, type_name=".v1.ContainerDevices"),
            _field("cpu_ids", 3, "TYPE_INT64", repeated=True),
        ],
        "ContainerDevices": [
            _field("resource_name", 1, "TYPE_STRING"),
            _field("device_ids", 2, "TYPE_STRING", repeated=True),
            _field("topology", 3, "TYPE_MESSAGE", type_name=".v1.TopologyInfo"),
        ],
        "TopologyInfo": [
            _field("nodes", 1, "TYPE_MESSAGE", repeated=True, type_name=".v1.NUMANode")
        ],
        "NUMANode": [_field("ID", 1, "TYPE_INT64")],
    }
    file = descriptor_pb2.FileDescriptorProto(
        name="zeus_async/podresources/v1/api.proto", package="v1", syntax="proto3"
    )
    for name, fields in messages.items():
        file.message_type.add(name=name).field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1.{name}"))
        for name in messages
    }


class KubernetesSource:
    """The GPUs each pod's containers hold, from the kubelet (see the module docstring).

    Args:
        socket: The kubelet's pod-resources socket.
        resources: Device-plugin resource names that are whole GPUs.
        timeout_s: How long one ``List`` may take.

    :meth:`list` connects on first use and keeps the channel (gRPC reconnects by itself when
    the kubelet restarts); :meth:`close` drops it.
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] = DEFAULT_SOCKET,
        *,
        resources: Iterable[str] = GPU_RESOURCES,
        timeout_s: float = 2.0,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self.socket = Path(socket)
        self.resources = frozenset(resources)
        self.timeout_s = timeout_s
        self._messages = podresources_messages()
        try:
            # gRPC's C core logs to stderr on its own (a kubelet that goes away: "Got goaway");
            # the source reports its failures once, through logging.
            os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
            import grpc
        except ImportError as exc:
            raise ConfigError(
                "the Kubernetes source needs grpcio: pip install 'zeus_async[k8s]'"
            ) from exc
        self._grpc: Any = grpc
        self._channel: Any = None
        self._list: Any = None

    def _check_socket(self) -> None:
        where = f"kubelet pod-resources socket {self.socket}"
        try:
            st = os.stat(self.socket)
        except FileNotFoundError:
            raise WorkloadSourceError(
                f"{where} not found: not a Kubernetes node, or the kubelet keeps it elsewhere "
                "(give its path)"
            ) from None
        except PermissionError:
            raise WorkloadSourceError(
                f"no permission to reach the {where} (run the agent as root)"
            ) from None
        if not stat.S_ISSOCK(st.st_mode):
            raise WorkloadSourceError(f"{where} is not a socket")
        if not os.access(self.socket, os.R_OK | os.W_OK):
            raise WorkloadSourceError(
                f"no permission to connect to the {where} (it is root's: run the agent as root)"
            )

    def _call(self) -> Any:
        if self._list is None:
            self._channel = self._grpc.insecure_channel(f"unix:{self.socket}")
            request = self._messages["ListPodResourcesRequest"]
            response = self._messages["ListPodResourcesResponse"]
            self._list = self._channel.unary_unary(
                LIST_METHOD,
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
        return self._list(self._messages["ListPodResourcesRequest"](), timeout=self.timeout_s)

    def list(self) -> list[PodGpus]:
        """Every container of the node that holds GPUs now (one ``List`` call).

        Raises:
            WorkloadSourceError: The socket is missing, not a socket, not ours to connect to,
                or the kubelet did not answer (one line: what and where).
        """
        self._check_socket()
        grpc = self._grpc
        try:
            reply = self._call()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = getattr(code, "name", "UNKNOWN")
            details = exc.details() if hasattr(exc, "details") else ""
            first = (details or "").strip().splitlines()[:1]
            where = f"kubelet pod-resources socket {self.socket}"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                msg = f"{where} did not answer List within {self.timeout_s:g} s"
            elif code == grpc.StatusCode.UNIMPLEMENTED:
                msg = f"{where} does not serve PodResources v1 List (kubelet older than 1.20?)"
            elif code == grpc.StatusCode.PERMISSION_DENIED:
                msg = f"no permission to list pod resources at {where}"
            else:
                msg = f"{where}: List failed ({name}{': ' + first[0] if first else ''})"
            raise WorkloadSourceError(msg) from None
        out: list[PodGpus] = []
        for pod in reply.pod_resources:
            for container in pod.containers:
                gpus: list[int | str] = []
                for device in container.devices:
                    if device.resource_name not in self.resources:
                        continue
                    for device_id in device.device_ids:
                        ref = gpu_ref(device_id)
                        if ref is None:
                            logger.debug(
                                "device %r of %s/%s left out", device_id, pod.name, container.name
                            )
                        else:
                            gpus.append(ref)
                if gpus:
                    out.append(
                        PodGpus(
                            namespace=pod.namespace,
                            pod=pod.name,
                            container=container.name,
                            gpus=tuple(dict.fromkeys(gpus)),
                        )
                    )
        return out

    def close(self) -> None:
        """Close the channel (a later :meth:`list` opens another)."""
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._list = None

    def __enter__(self) -> KubernetesSource:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
