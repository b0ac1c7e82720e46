"""RAPL energy counters (Intel and AMD CPUs) read from the Linux powercap sysfs tree.

Layout (``/sys/class/powercap``; the root is configurable so tests can point at a fake tree)::

    intel-rapl:0        name = package-0   one CPU package (socket)
    intel-rapl:0:0      name = core        sub-zones of package 0
    intel-rapl:0:1      name = uncore
    intel-rapl:0:2      name = dram
    intel-rapl:1        name = psys        platform zone (client CPUs), reported under package 0

Every zone directory holds ``name``, ``energy_uj`` (a wrapping µJ counter) and
``max_energy_range_uj`` (the counter's range). Zones are identified by their ``name`` file, never
by their index (which differs between client and server parts). The ``intel-rapl-mmio:*`` zones
(an MMIO view of the same package counter) and ``amd-rapl:*`` zones are accepted too; when
the same package/domain appears under several prefixes the ``intel-rapl`` one wins, then
``amd-rapl``, then ``intel-rapl-mmio``.

Reading. Each ``energy_uj`` file is opened once and re-read with ``os.pread(fd, n, 0)``: a read
at offset 0 makes sysfs (kernfs/seq_file) regenerate the attribute, and on a regular file (the
fake tree used in tests) it reads the current contents, so one code path serves both. Every
open goes through :func:`_open_ro`, which tests may replace to emulate an unprivileged process
(see :class:`zeus_async.testing.fake_sysfs.FakePowercap.unprivileged`).

Unwrapping. The counter is kept as exact integers (µJ); ``energy_j`` is ``total_uj / 1e6``.
Any decrease between two reads is taken as one wrap and the range is added. This assumes *at
most one wrap between two reads of a domain*: a package counter has a range of about 262 kJ,
which takes over 10 minutes to cover even at 400 W, so at the 10 ms to 1 s cadence of the
sampler it cannot wrap twice. (The hardware counter really wraps at ``range + 1 energy unit``;
the unit, 15 to 61 µJ, is not exposed in sysfs, so each wrap may miss that one unit, as in every
sysfs-based RAPL reader.)

Permissions. Since the fix for CVE-2020-8694 (Linux 5.10 and stable back-ports) ``energy_uj``
is readable only by root. A counter that cannot be opened raises
:class:`~zeus_async.errors.NoPermissionError` with instructions; it is never reported as 0 J.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, cast, get_args

from ..errors import (
    DeviceError,
    DeviceLostError,
    DeviceNotFoundError,
    NoPermissionError,
    TransientDeviceError,
)
from ..events import Capabilities, DeviceInfo, Event, RaplDomain, RaplSample

__all__ = [
    "DEFAULT_POWERCAP_ROOT",
    "RAPL_DOMAINS",
    "RaplPackage",
    "RaplZone",
    "find_rapl_zones",
    "open_rapl_packages",
    "rapl_available",
    "unwrap_delta_uj",
]

logger = logging.getLogger(__name__)

#: Where the kernel exposes powercap zones.
DEFAULT_POWERCAP_ROOT: Final = "/sys/class/powercap"

#: Every RAPL domain, in the order a package reports them.
RAPL_DOMAINS: Final[tuple[RaplDomain, ...]] = get_args(RaplDomain)

_SUB_DOMAINS: Final[frozenset[str]] = frozenset({"core", "uncore", "dram"})
# Preference when one package/domain is exposed by several control types.
_PREFIX_RANK: Final[dict[str, int]] = {"intel-rapl": 0, "amd-rapl": 1, "intel-rapl-mmio": 2}
_ZONE_RE: Final = re.compile(r"^(intel-rapl|amd-rapl|intel-rapl-mmio):(\d+)(?::(\d+))?$")
_PACKAGE_NAME_RE: Final = re.compile(r"^package-(\d+)$")
# "%llu\n" is at most 21 bytes; read more so that an over-long value is detected, not truncated.
_READ_SIZE: Final = 64


def _open_ro(path: str) -> int:
    """Open ``path`` read-only and return the descriptor.

    Every file access of this module goes through here, so tests can emulate the permission
    checks of an unprivileged process (root, which runs many CI jobs, bypasses file modes).
    """
    return os.open(path, os.O_RDONLY)


def _not_found_message(root: Path) -> str:
    return (
        f"no RAPL powercap zones under {root}; is the intel_rapl kernel module loaded? "
        "(try `sudo modprobe intel_rapl_msr`; RAPL needs a Linux host with an Intel or AMD "
        "CPU, and is usually not exposed inside virtual machines)"
    )


def _permission_message(path: Path, root: Path) -> str:
    return (
        f"permission denied reading {path}: since the fix for CVE-2020-8694 (Linux 5.10 and "
        "stable back-ports) RAPL energy counters are readable only by root. Either run as "
        f"root, or grant read access until the next reboot with `sudo chmod o+r "
        f"{root}/intel-rapl:*/energy_uj {root}/intel-rapl:*:*/energy_uj`, or persistently "
        "with a udev rule such as "
        '`SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chmod o+r /sys%p/energy_uj"` '
        "in /etc/udev/rules.d/99-rapl.rules"
    )


def _os_error(exc: OSError, path: Path, root: Path, device: str) -> DeviceError:
    """Map an ``OSError`` raised on a powercap file to the matching :class:`DeviceError`."""
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM):
        return NoPermissionError(_permission_message(path, root), device=device, code=exc.errno)
    detail = f"{path}: {exc.strerror or exc}"
    if exc.errno in (errno.ENOENT, errno.ENODEV, errno.ENXIO):
        return DeviceLostError(
            f"RAPL zone disappeared ({detail}); was the intel_rapl module unloaded?",
            device=device,
            code=exc.errno,
        )
    if exc.errno in (errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.EIO):
        return TransientDeviceError(f"reading {detail}", device=device, code=exc.errno)
    return DeviceError(f"reading {detail}", device=device, code=exc.errno)


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, _READ_SIZE, 0)


def _read_small(path: Path, root: Path, device: str) -> bytes:
    try:
        fd = _open_ro(str(path))
    except OSError as exc:
        raise _os_error(exc, path, root, device) from None
    try:
        return _read_fd(fd)
    except OSError as exc:
        raise _os_error(exc, path, root, device) from None
    finally:
        os.close(fd)


def _parse_uj(data: bytes, path: Path, device: str) -> int:
    """Parse a sysfs µJ value (``"%llu\\n"``) strictly; anything else is a :class:`DeviceError`."""
    text = data.strip()
    if not text or not text.isdigit() or len(text) > 20:
        shown = data[:32].decode("ascii", "backslashreplace")
        raise DeviceError(
            f"malformed RAPL counter in {path}: expected a non-negative integer, got {shown!r}",
            device=device,
        )
    return int(text)


def unwrap_delta_uj(previous_uj: int, current_uj: int, range_uj: int) -> int:
    """Energy consumed between two readings of a wrapping counter, in µJ.

    Any decrease is taken as exactly one wrap through ``range_uj`` (see the module docstring
    for why at most one wrap can happen between two samples).

    Args:
        previous_uj: Earlier counter value, in ``[0, range_uj]``.
        current_uj: Later counter value, in ``[0, range_uj]``.
        range_uj: The counter's ``max_energy_range_uj``.

    Returns:
        The non-negative increment in µJ.
    """
    delta = current_uj - previous_uj
    if delta < 0:
        delta += range_uj
    return delta


@dataclass(frozen=True)
class RaplZone:
    """One discovered powercap zone that maps to a RAPL domain.

    Attributes:
        package: CPU package index (from the ``package-<N>`` name; ``psys`` belongs to 0).
        domain: The RAPL domain.
        path: The zone directory.
        zone: The directory name, e.g. ``intel-rapl:0:1``.
    """

    package: int
    domain: RaplDomain
    path: Path
    zone: str


def _zone_name(path: Path, root: Path) -> str | None:
    try:
        data = _read_small(path / "name", root, "")
    except DeviceError as exc:
        logger.warning("RAPL: skipping zone %s: cannot read its name (%s)", path.name, exc)
        return None
    return data.decode("utf-8", "replace").strip()


def _list_zone_dirs(root: Path) -> dict[str, Path]:
    """Zone directories by name: the flat listing plus sub-zones nested in zone directories."""
    found: dict[str, Path] = {}
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return found
    for entry in entries:
        if _ZONE_RE.match(entry) and (root / entry).is_dir():
            found[entry] = root / entry
    # Also look one level down: control-type dirs (``intel-rapl/``) and zone dirs hold their
    # children, which matters when ``root`` is not the flat /sys/class/powercap listing.
    for entry in entries:
        path = root / entry
        if (entry in _PREFIX_RANK or _ZONE_RE.match(entry)) and path.is_dir():
            try:
                children = sorted(os.listdir(path))
            except OSError:
                continue
            for child in children:
                if _ZONE_RE.match(child) and (path / child).is_dir():
                    found.setdefault(child, path / child)
    return found


def _zone_sort_key(name: str) -> tuple[int, int, int]:
    match = _ZONE_RE.match(name)
    assert match is not None
    prefix, top, sub = match.groups()
    return (_PREFIX_RANK[prefix], int(top), -1 if sub is None else int(sub))


def find_rapl_zones(root: str | Path = DEFAULT_POWERCAP_ROOT) -> list[RaplZone]:
    """Discover the RAPL zones under a powercap root (reads only ``name`` files).

    Zones whose name is not a known RAPL domain, and duplicates of a zone already found under
    a preferred prefix (``intel-rapl`` > ``amd-rapl`` > ``intel-rapl-mmio``), are skipped and
    logged at INFO.

    Args:
        root: The powercap directory.

    Returns:
        The zones, sorted by package then domain order (:data:`RAPL_DOMAINS`); empty when
        there are none (or ``root`` does not exist).
    """
    root = Path(root)
    dirs = _list_zone_dirs(root)
    names = {zone: _zone_name(path, root) for zone, path in dirs.items()}
    # Package number of each top-level zone, from its name (the index may differ from it).
    top_package: dict[tuple[str, str], int] = {}
    for zone, name in names.items():
        match = _ZONE_RE.match(zone)
        assert match is not None
        pkg_match = _PACKAGE_NAME_RE.match(name or "")
        if match.group(3) is None and pkg_match:
            top_package[(match.group(1), match.group(2))] = int(pkg_match.group(1))

    chosen: dict[tuple[int, RaplDomain], RaplZone] = {}
    for zone in sorted(dirs, key=_zone_sort_key):
        name = names[zone]
        if name is None:
            continue
        match = _ZONE_RE.match(zone)
        assert match is not None
        prefix, top, sub = match.groups()
        package: int | None = None
        domain: RaplDomain | None = None
        if sub is None:
            pkg_match = _PACKAGE_NAME_RE.match(name)
            if pkg_match:
                package, domain = int(pkg_match.group(1)), "package"
            elif name == "psys":
                package, domain = 0, "psys"
        elif name in _SUB_DOMAINS:
            package = top_package.get((prefix, top))
            domain = cast("RaplDomain", name)  # checked against _SUB_DOMAINS
        if package is None or domain is None:
            logger.info("RAPL: skipping zone %s (name %r is not a known RAPL domain)", zone, name)
            continue
        previous = chosen.get((package, domain))
        if previous is not None:
            logger.info(
                "RAPL: skipping zone %s (package %d %s already read from %s)",
                zone,
                package,
                domain,
                previous.zone,
            )
            continue
        chosen[(package, domain)] = RaplZone(package, domain, dirs[zone], zone)
    return sorted(chosen.values(), key=lambda z: (z.package, RAPL_DOMAINS.index(z.domain)))


class _Counter:
    """State of one domain's counter: open fd, range, last raw value, unwrapped total."""

    __slots__ = ("domain", "fd", "last_raw", "last_t_ns", "path", "range_uj", "total_uj")

    def __init__(self, domain: RaplDomain, path: Path, fd: int, range_uj: int) -> None:
        self.domain: RaplDomain = domain
        self.path = path
        self.fd = fd
        self.range_uj = range_uj
        self.last_raw: int | None = None
        self.last_t_ns = 0
        self.total_uj = 0


class RaplPackage:
    """One CPU package and its RAPL domains, implementing the :class:`~.base.Device` protocol.

    Use :func:`open_rapl_packages` rather than constructing it directly.

    ``read`` returns one :class:`~zeus_async.events.RaplSample` per requested domain, with
    ``energy_j`` the unwrapped energy since that domain's first read (so the first read gives
    0.0 J) and ``power_w`` the mean power since the previous read of the domain, from the
    ``t_ns`` values passed in (``None`` on the first read, or when ``t_ns`` did not advance).
    Requested names that are not domains of this package are ignored. A read that fails for
    any domain raises and leaves every domain's state unchanged. Thread-safe.

    Args:
        package: The package index.
        zones: Its zones (all with this package index).
        root: The powercap root, for error messages.

    Raises:
        NoPermissionError: A counter cannot be opened (see the message for the fix).
        DeviceError: A counter or its range is malformed, or another OS error.
    """

    def __init__(
        self,
        package: int,
        zones: Sequence[RaplZone],
        root: str | Path = DEFAULT_POWERCAP_ROOT,
    ) -> None:
        self._package = package
        self._key = f"cpu:{package}"
        self._root = Path(root)
        self._lock = threading.Lock()
        self._closed = False
        self._counters: list[_Counter] = []
        try:
            for zone in sorted(zones, key=lambda z: RAPL_DOMAINS.index(z.domain)):
                if zone.package != package:
                    raise ValueError(f"zone {zone.zone} is not in package {package}")
                self._counters.append(self._open_counter(zone))
        except BaseException:
            self.close()
            raise
        self._fields: tuple[str, ...] = tuple(c.domain for c in self._counters)

    def _open_counter(self, zone: RaplZone) -> _Counter:
        range_path = zone.path / "max_energy_range_uj"
        range_uj = _parse_uj(_read_small(range_path, self._root, self._key), range_path, self._key)
        if range_uj <= 0:
            raise DeviceError(
                f"invalid RAPL counter range in {range_path}: {range_uj} (must be > 0)",
                device=self._key,
            )
        path = zone.path / "energy_uj"
        try:
            fd = _open_ro(str(path))
        except OSError as exc:
            raise _os_error(exc, path, self._root, self._key) from None
        counter = _Counter(zone.domain, path, fd, range_uj)
        try:
            self._read_raw(counter)  # fail now, not at the first sample
        except BaseException:
            os.close(fd)
            raise
        return counter

    @property
    def key(self) -> str:
        """``"cpu:<package>"``."""
        return self._key

    @property
    def package(self) -> int:
        """The CPU package index."""
        return self._package

    @property
    def fields(self) -> tuple[str, ...]:
        """The RAPL domains this package has, in :data:`RAPL_DOMAINS` order."""
        return self._fields

    def max_energy_range_uj(self, domain: str) -> int:
        """The counter range of ``domain`` (µJ). Raises ``KeyError`` for an absent domain."""
        for counter in self._counters:
            if counter.domain == domain:
                return counter.range_uj
        raise KeyError(domain)

    def describe(self) -> DeviceInfo:
        """Static description: ``DeviceInfo(key, "CPU package <n> (RAPL)", arch="cpu")``."""
        return DeviceInfo(
            key=self._key,
            name=f"CPU package {self._package} (RAPL)",
            arch="cpu",
            has_energy_counter=True,
            energy_method="counter",
            capabilities=Capabilities(energy_counter=True),
        )

    def _read_raw(self, counter: _Counter) -> int:
        try:
            data = _read_fd(counter.fd)
        except OSError as exc:
            raise _os_error(exc, counter.path, self._root, self._key) from None
        raw = _parse_uj(data, counter.path, self._key)
        if raw > counter.range_uj:
            raise DeviceError(
                f"RAPL counter {counter.path} reads {raw} µJ, above its range "
                f"max_energy_range_uj={counter.range_uj}",
                device=self._key,
            )
        return raw

    def read(self, fields: Collection[str], host: str, t_ns: int) -> Sequence[Event]:
        """Read the requested domains.

        Args:
            fields: Domain names to read; names this package lacks are ignored.
            host: Host id stamped on the samples.
            t_ns: Wall-clock time of the reading, used for the power computation.

        Returns:
            One :class:`~zeus_async.events.RaplSample` per requested domain present.

        Raises:
            DeviceError: The package is closed, a counter is malformed or cannot be read
                (``NoPermissionError``, ``DeviceLostError``, ``TransientDeviceError``).
        """
        with self._lock:
            if self._closed:
                raise DeviceError(f"{self._key} (RAPL) is closed", device=self._key)
            counters = [c for c in self._counters if c.domain in fields]
            raws = [self._read_raw(c) for c in counters]
            samples: list[Event] = []
            for counter, raw in zip(counters, raws, strict=True):
                power_w: float | None = None
                if counter.last_raw is not None:
                    delta = unwrap_delta_uj(counter.last_raw, raw, counter.range_uj)
                    counter.total_uj += delta
                    dt_ns = t_ns - counter.last_t_ns
                    if dt_ns > 0:
                        power_w = delta * 1e3 / dt_ns  # µJ/ns = 1e3 W
                counter.last_raw = raw
                counter.last_t_ns = t_ns
                samples.append(
                    RaplSample(
                        host=host,
                        t_ns=t_ns,
                        package=self._package,
                        domain=counter.domain,
                        energy_j=counter.total_uj / 1e6,
                        power_w=power_w,
                    )
                )
            return samples

    def close(self) -> None:
        """Close the counter files. Idempotent."""
        with self._lock:
            self._closed = True
            counters, self._counters = self._counters, []
        for counter in counters:
            try:
                os.close(counter.fd)
            except OSError:
                pass

    def __enter__(self) -> RaplPackage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RaplPackage({self._package}, domains={self._fields}, root={str(self._root)!r})"


def open_rapl_packages(
    root: str | Path = DEFAULT_POWERCAP_ROOT,
    *,
    packages: Sequence[int] | None = None,
) -> list[RaplPackage]:
    """Discover and open the RAPL packages under a powercap root.

    Logs at INFO, once per call, which domains each package has and which it lacks.

    Args:
        root: The powercap directory (``/sys/class/powercap`` on a real host).
        packages: Package indices to open; ``None`` opens all of them.

    Returns:
        One :class:`RaplPackage` per package, sorted by index.

    Raises:
        DeviceNotFoundError: No RAPL zone exists under ``root``, or a requested package is
            absent.
        NoPermissionError: A counter is not readable by this process (the message says how
            to grant access).
        DeviceError: A counter or its range holds malformed data.
    """
    root = Path(root)
    zones = find_rapl_zones(root)
    if not zones:
        raise DeviceNotFoundError(_not_found_message(root))
    by_package: dict[int, list[RaplZone]] = {}
    for zone in zones:
        by_package.setdefault(zone.package, []).append(zone)
    wanted = sorted(by_package) if packages is None else list(dict.fromkeys(packages))
    missing = [p for p in wanted if p not in by_package]
    if missing:
        raise DeviceNotFoundError(
            f"RAPL package(s) {missing} not found under {root}; "
            f"found package(s) {sorted(by_package)}",
            device=f"cpu:{missing[0]}",
        )
    opened: list[RaplPackage] = []
    try:
        for package in sorted(wanted):
            device = RaplPackage(package, by_package[package], root)
            opened.append(device)
            absent = [d for d in RAPL_DOMAINS if d not in device.fields]
            logger.info(
                "RAPL package %d: domains %s (not present: %s)",
                package,
                ", ".join(device.fields),
                ", ".join(absent) or "none",
            )
    except BaseException:
        for device in opened:
            device.close()
        raise
    return opened


def rapl_available(root: str | Path = DEFAULT_POWERCAP_ROOT) -> bool:
    """Whether RAPL energy can be measured here: zones exist *and* their counters are readable.

    Never raises; call :func:`open_rapl_packages` to learn why it is ``False``.
    """
    try:
        devices = open_rapl_packages(root)
    except DeviceError:
        return False
    for device in devices:
        device.close()
    return True
