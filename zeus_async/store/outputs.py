"""Outputs that never destroy data: no silent overwrite, never an input as an output.

Every command and API that writes a file (a recording, an export, a plot) claims its output
here first:

- an output that is one of the inputs, or a part of one (``run.1.zarc`` of a rotated
  ``run.zarc``, a hard or symbolic link to it), is refused always, even with ``--force``:
  it would be truncated while it is read;
- an existing output is refused unless the caller asked to overwrite it (``--force``,
  ``overwrite=True``); a recording replaced this way also loses its old rotated parts, which
  would otherwise be read as the continuation of the new one.

Errors say which file and why in one line: :class:`FileExistsError` (with ``filename``) for an
existing output, :class:`~zeus_async.errors.ConfigError` for an output that is an input.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError
from .format import recording_parts

__all__ = ["claim_output"]

logger = logging.getLogger(__name__)


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they would be
        return a.resolve() == b.resolve()


def claim_output(
    path: str | os.PathLike[str],
    *,
    inputs: Iterable[str | os.PathLike[str]] = (),
    overwrite: bool = False,
    what: str = "output",
    recording: bool = False,
    force_hint: str = "--force",
) -> Path:
    """Check that ``path`` may be written; returns it as a :class:`~pathlib.Path`.

    Args:
        path: The file about to be written.
        inputs: Recordings (or other files) read by the same command; each with all its
            rotated parts.
        overwrite: Replace an existing ``path`` (and, for a recording, drop its old parts).
        what: What ``path`` is, for messages ("export", "recording", "image").
        recording: ``path`` is a recording: its rotated parts count as the file too.
        force_hint: How the user asks to overwrite (``--force`` or ``overwrite=True``).

    Raises:
        ConfigError: ``path`` is one of ``inputs`` or one of their parts.
        FileExistsError: ``path`` (or one of its rotated parts) exists and ``overwrite`` is
            false.
        IsADirectoryError: ``path`` is a directory.
        FileNotFoundError: ``path``'s directory does not exist.
        PermissionError: ``path``'s directory is not writable.

    With ``overwrite=True`` and no ``inputs`` it only checks that ``path`` can be written
    (appending outputs such as the window log use it so).
    """
    out = Path(path)
    for given in inputs:
        parts = recording_parts(given)
        for k, part in enumerate(parts):
            if _same(out, part):
                which = "the input" if k == 0 else f"part {k} of the input"
                raise ConfigError(
                    f"refusing to write {what} {out}: it is {which} {Path(given)} "
                    "(choose another output file)"
                )
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"{what} is a directory", str(out))
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(
            errno.ENOENT, f"the directory of the {what} does not exist", str(out)
        )
    if not os.access(folder, os.W_OK):
        raise PermissionError(errno.EACCES, f"cannot write the {what} in its directory", str(out))
    # Only regular files hold data to lose: a pipe or a device (/dev/null) is written to.
    existing = [p for p in recording_parts(out) if p.is_file()] if recording else []
    if not recording and out.is_file():
        existing = [out]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} rotated part(s))" if len(existing) > 1 else ""
        raise FileExistsError(
            errno.EEXIST,
            f"{what} exists{more}; refusing to overwrite it ({force_hint} replaces it)",
            str(out),
        )
    if recording and overwrite:
        for stale in existing[1:]:
            stale.unlink()
            logger.info("removed %s, a part of the recording being replaced", stale)
    return out
