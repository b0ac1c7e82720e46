"""A fake Linux powercap tree, so the RAPL backend runs unchanged in tests.

:class:`FakePowercap` lays out the same directories as ``/sys/class/powercap``: a control-type
directory ``intel-rapl/`` holding the zones (sub-zones nested inside their package), plus the
flat symlinks ``intel-rapl:0``, ``intel-rapl:0:0``... that the kernel puts at the top level.
Counters are plain files rewritten *in place* (same inode), so a reader that keeps the file open
and re-reads it with ``pread`` sees every update, as it does on sysfs.

Permissions. Patched kernels (CVE-2020-8694) make ``energy_uj`` mode ``0400`` owned by root.
:meth:`FakePowercap.restrict` gives the fake file the equivalent mode (``0600``: only the owner
reads it; the owner keeps write access so the fake can still advance it). That is enough to make
the real kernel refuse an unprivileged process that does not own the file (a test can check this
honestly by dropping privileges in a forked child). A test process that runs as root, or owns
the files, is not refused by the kernel, so :meth:`FakePowercap.unprivileged` emulates the
check: while it is active, the RAPL backend's single open function
(``zeus_async.devices.rapl._open_ro``) raises ``PermissionError(EACCES)`` for files of this tree
that are not readable by "others", exactly what an unprivileged non-owner would get. Nothing
else about the reader is altered, and no flag in the reader itself is consulted.

Not thread-safe: a reader racing a counter update may see the truncated file. Tests update and
read in turn.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Final

__all__ = ["DEFAULT_RANGE_UJ", "FakePowercap"]

#: ``max_energy_range_uj`` of a typical package counter: (2**32 - 1) units of 61 µJ ≈ 262 kJ.
DEFAULT_RANGE_UJ: Final = 262_143_328_850

_SUB_DOMAINS: Final = ("core", "uncore", "dram")
_COUNTER_MODE: Final = 0o644  # readable by all, as after `chmod o+r` or on old kernels
_RESTRICTED_MODE: Final = 0o600  # owner only, like the root-only 0400 of patched kernels


class FakePowercap:
    """A powercap tree under ``root`` with RAPL zones whose counters tests control.

    Args:
        root: Directory to create the tree in (created if missing); pass it to
            :func:`zeus_async.devices.rapl.open_rapl_packages`.

    Example::

        fake = FakePowercap(tmp_path / "powercap")
        fake.add_package(0, ("core", "dram"))
        fake.add_energy_j(0, "package", 12.5)
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._zones: dict[tuple[int, str], Path] = {}
        self._ranges: dict[tuple[int, str], int] = {}
        self._values: dict[tuple[int, str], int] = {}
        self._next_top: dict[str, int] = {}

    # -- building -----------------------------------------------------------------------------

    def _control_dir(self, prefix: str) -> Path:
        path = self.root / prefix
        if not path.exists():
            path.mkdir()
            (path / "enabled").write_text("1\n")
        return path

    def _make_zone(
        self,
        parent: Path,
        zone: str,
        name: str,
        key: tuple[int, str],
        range_uj: int,
        energy_uj: int,
    ) -> None:
        if key in self._zones:
            raise ValueError(f"package {key[0]} already has a {key[1]} zone")
        if range_uj <= 0 or not 0 <= energy_uj <= range_uj:
            raise ValueError(
                f"need 0 <= energy_uj ({energy_uj}) <= range ({range_uj}) and range > 0"
            )
        path = parent / zone
        path.mkdir()
        (path / "name").write_text(f"{name}\n")
        (path / "max_energy_range_uj").write_text(f"{range_uj}\n")
        (path / "energy_uj").write_text(f"{energy_uj}\n")
        (path / "energy_uj").chmod(_COUNTER_MODE)
        (path / "enabled").write_text("1\n")
        (self.root / zone).symlink_to(path.relative_to(self.root))
        self._zones[key] = path
        self._ranges[key] = range_uj
        self._values[key] = energy_uj

    def add_package(
        self,
        package: int,
        domains: Iterable[str] = ("core", "uncore", "dram"),
        *,
        max_energy_range_uj: int | Mapping[str, int] = DEFAULT_RANGE_UJ,
        energy_uj: int | Mapping[str, int] = 0,
        prefix: str = "intel-rapl",
        name: str | None = None,
    ) -> None:
        """Add a package zone ``<prefix>:<i>`` and its sub-zones.

        Args:
            package: Package index (the zone is named ``package-<package>``).
            domains: Sub-domains to create, among ``core``, ``uncore``, ``dram``, in the order
                of their sub-zone index. The ``package`` domain always exists.
            max_energy_range_uj: Counter range, for all domains or per domain name.
            energy_uj: Initial counter value, for all domains or per domain name.
            prefix: Control type: ``intel-rapl``, ``amd-rapl`` or ``intel-rapl-mmio``.
            name: Override the zone's ``name`` file (to test unknown names).
        """

        def pick(value: int | Mapping[str, int], domain: str, default: int) -> int:
            return value.get(domain, default) if isinstance(value, Mapping) else value

        index = self._next_top.get(prefix, 0)
        self._next_top[prefix] = index + 1
        control = self._control_dir(prefix)
        zone = f"{prefix}:{index}"
        key_prefix = "" if prefix == "intel-rapl" else f"{prefix}/"
        self._make_zone(
            control,
            zone,
            name or f"package-{package}",
            (package, key_prefix + "package"),
            pick(max_energy_range_uj, "package", DEFAULT_RANGE_UJ),
            pick(energy_uj, "package", 0),
        )
        for sub, domain in enumerate(domains):
            if domain not in _SUB_DOMAINS:
                raise ValueError(f"unknown sub-domain {domain!r}; use one of {_SUB_DOMAINS}")
            self._make_zone(
                control / zone,
                f"{zone}:{sub}",
                domain,
                (package, key_prefix + domain),
                pick(max_energy_range_uj, domain, DEFAULT_RANGE_UJ),
                pick(energy_uj, domain, 0),
            )

    def add_psys(self, *, max_energy_range_uj: int = DEFAULT_RANGE_UJ, energy_uj: int = 0) -> None:
        """Add the platform zone (a top-level ``intel-rapl:<i>`` named ``psys``).

        It is addressed as package 0, domain ``"psys"``.
        """
        index = self._next_top.get("intel-rapl", 0)
        self._next_top["intel-rapl"] = index + 1
        self._make_zone(
            self._control_dir("intel-rapl"),
            f"intel-rapl:{index}",
            "psys",
            (0, "psys"),
            max_energy_range_uj,
            energy_uj,
        )

    def add_zone(self, zone: str, name: str, *, energy_uj: int = 0) -> Path:
        """Add an arbitrary top-level zone directory (e.g. an unknown domain); returns it.

        The zone is not addressable through the counter methods.
        """
        path = self.root / zone
        path.mkdir()
        (path / "name").write_text(f"{name}\n")
        (path / "max_energy_range_uj").write_text(f"{DEFAULT_RANGE_UJ}\n")
        (path / "energy_uj").write_text(f"{energy_uj}\n")
        return path

    # -- counters -----------------------------------------------------------------------------

    def zone_path(self, package: int, domain: str) -> Path:
        """The zone directory of ``domain`` of ``package``.

        Zones added under another prefix than ``intel-rapl`` are addressed as
        ``"<prefix>/<domain>"``, e.g. ``"intel-rapl-mmio/package"``.
        """
        try:
            return self._zones[(package, domain)]
        except KeyError:
            raise KeyError(f"no {domain!r} zone in fake package {package}") from None

    def max_energy_range_uj(self, package: int, domain: str) -> int:
        """The counter range of a zone."""
        self.zone_path(package, domain)
        return self._ranges[(package, domain)]

    def energy_uj(self, package: int, domain: str) -> int:
        """The counter value last written."""
        self.zone_path(package, domain)
        return self._values[(package, domain)]

    def _write(self, path: Path, text: str) -> None:
        # In place (same inode), like sysfs, so open descriptors see the new value.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def set_energy_uj(self, package: int, domain: str, value: int) -> None:
        """Set a counter to ``value`` µJ (``0 <= value <= max_energy_range_uj``)."""
        path = self.zone_path(package, domain)
        range_uj = self._ranges[(package, domain)]
        if not 0 <= value <= range_uj:
            raise ValueError(f"counter value {value} outside [0, {range_uj}]")
        self._write(path / "energy_uj", f"{value}\n")
        self._values[(package, domain)] = value

    def add_energy_uj(self, package: int, domain: str, microjoules: int) -> None:
        """Advance a counter by ``microjoules``, wrapping modulo its range like the hardware."""
        if microjoules < 0:
            raise ValueError("energy counters only go up")
        key = (package, domain)
        self.zone_path(package, domain)
        self.set_energy_uj(package, domain, (self._values[key] + microjoules) % self._ranges[key])

    def add_energy_j(self, package: int, domain: str, joules: float) -> None:
        """Advance a counter by ``joules`` (rounded to whole µJ), wrapping like the hardware."""
        self.add_energy_uj(package, domain, round(joules * 1e6))

    def write_raw(self, package: int, domain: str, text: str, file: str = "energy_uj") -> None:
        """Write arbitrary text into one of a zone's files (to test malformed contents)."""
        self._write(self.zone_path(package, domain) / file, text)

    # -- permissions --------------------------------------------------------------------------

    def restrict(self, package: int | None = None, domain: str | None = None) -> None:
        """Make counters readable by their owner only, like patched kernels (root-only).

        Args:
            package: Only this package (default: every package).
            domain: Only this domain (default: every domain).
        """
        for (pkg, dom), path in self._zones.items():
            if (package is None or pkg == package) and (domain is None or dom == domain):
                (path / "energy_uj").chmod(_RESTRICTED_MODE)

    @contextlib.contextmanager
    def unprivileged(self) -> Iterator[None]:
        """Emulate, for files of this tree, the permission check an unprivileged process gets.

        While active, opening a file under :attr:`root` through the RAPL backend raises
        ``PermissionError(EACCES)`` unless the file is readable by "others" (``S_IROTH``), as
        it would for a non-root process that does not own it. See the module docstring.
        """
        from ..devices import rapl

        real_open = rapl._open_ro
        root = os.path.realpath(self.root)

        def checked_open(path: str) -> int:
            real_path = os.path.realpath(path)
            inside = os.path.commonpath([root, real_path]) == root
            if inside and not os.stat(real_path).st_mode & stat.S_IROTH:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_open(path)

        rapl._open_ro = checked_open
        try:
            yield
        finally:
            rapl._open_ro = real_open
