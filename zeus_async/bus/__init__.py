"""The event bus: events framed on ZeroMQ PUB/SUB with sequence numbers, a proxy, CURVE security.

The byte-level wire format is specified in ``docs/wire-format.md``.
"""

from __future__ import annotations

from ._endpoints import default_endpoint as default_endpoint
from .codec import FLAG_FINAL as FLAG_FINAL
from .codec import HEADER_SIZE as HEADER_SIZE
from .codec import Frame as Frame
from .codec import FrameDecoder as FrameDecoder
from .codec import FrameEncoder as FrameEncoder
from .codec import FrameHeader as FrameHeader
from .codec import pack_header as pack_header
from .codec import unpack_header as unpack_header
from .curve import CurveClientKeys as CurveClientKeys
from .curve import CurveServerKeys as CurveServerKeys
from .curve import generate_certificates as generate_certificates
from .curve import load_client_keys as load_client_keys
from .curve import load_server_keys as load_server_keys
from .curve import start_authenticator as start_authenticator
from .proxy import run_proxy as run_proxy
from .publisher import Publisher as Publisher
from .publisher import PublisherStats as PublisherStats
from .subscriber import StreamStats as StreamStats
from .subscriber import Subscriber as Subscriber
from .subscriber import SubscriberStats as SubscriberStats

__all__ = [
    "FLAG_FINAL",
    "HEADER_SIZE",
    "CurveClientKeys",
    "CurveServerKeys",
    "Frame",
    "FrameDecoder",
    "FrameEncoder",
    "FrameHeader",
    "Publisher",
    "PublisherStats",
    "StreamStats",
    "Subscriber",
    "SubscriberStats",
    "default_endpoint",
    "generate_certificates",
    "load_client_keys",
    "load_server_keys",
    "pack_header",
    "run_proxy",
    "start_authenticator",
    "unpack_header",
]
