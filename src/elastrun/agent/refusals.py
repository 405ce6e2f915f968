"""Nodes the job refused, said by the nodes that wait for them.

A node started with settings that differ from the job's (``--nnodes``,
``--node-unit``, ...: a config mismatch) is refused: it says so and exits,
and before it exits it leaves the ``refused`` job note
(:class:`~elastrun.rendezvous.notes.RefusalNote`: the last refusal, one key).
While this agent waits in the rendezvous (:meth:`RefusalWatch.start` /
:meth:`~RefusalWatch.stop` around ``next_round``), it reads that note every
``every`` seconds and says each new refusal once: the first node, waiting
for a peer that will never come, says why instead of counting down its join
timeout in silence. The note is untrusted (anyone who reaches the store may
write it): read typed and bounded, and printed escaped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from elastrun.rendezvous.api import Rendezvous
from elastrun.rendezvous.notes import RefusalNote
from elastrun.untrusted import printable

__all__ = ["RefusalWatch"]

EVERY = 2.0  # seconds between two reads of the note while waiting


class RefusalWatch:
    """Says, while :meth:`start`-ed, each refusal that appears (see the module doc)."""

    def __init__(
        self,
        rendezvous: Rendezvous,
        say: Callable[[str], None],
        every: float = EVERY,
    ) -> None:
        self.rendezvous = rendezvous
        self.say = say
        self.every = every
        self._seen: RefusalNote | None = None
        self._first = True  # the note found at the first read: an older refusal
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.stop()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    async def _run(self) -> None:
        while True:
            note = await self.rendezvous.read_note(RefusalNote)
            if note is not None and note != self._seen and not self._first:
                self.say(
                    f"elastrun: node {printable(note.host, limit=300)} ({note.node_id}) was "
                    f"refused by this job and will not join: {printable(note.message)}"
                )
            if note is not None:
                self._seen = note
            self._first = False
            await asyncio.sleep(self.every)
