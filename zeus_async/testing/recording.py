"""Writing recordings in tests: :func:`record_events` runs a real :class:`Recorder` over a list.

Unlike :func:`~zeus_async.store.write_recording` (a synchronous writer of frames), this goes
through everything the recorder does live: its batches, flush timer, rotation, dropped events.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from ..events import Event
from ..runtime.hub import EventBatches
from ..store import Recorder

__all__ = ["record_events"]


def record_events(recorder: Recorder, events: Sequence[Event]) -> Recorder:
    """Feed ``events`` to ``recorder`` as a runtime would, until the stream ends; returns it."""

    async def main() -> None:
        batches = EventBatches(len(events) + 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(recorder.run, batches)
            for event in events:
                await batches.send(event)
            batches.close()

    anyio.run(main)
    return recorder
