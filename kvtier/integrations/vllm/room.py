"""Whether a hit the scheduler's mirror sees in the worker's RAM tier is still there at its load.

A load planned in the scheduler runs in the worker one or two steps later (vLLM's asynchronous
scheduling plans step N+1 while step N runs). In between, the worker's top tier may evict the
hit's chunks to make room for what those steps add: the saves they were given, and the chunks
background loads promote from lower tiers. A dense model's load that finds a chunk gone is
reported per block and vLLM recomputes it; vLLM 0.32 takes no per-block failures for a model with
several KV cache groups, only per request for requests waiting for an asynchronous load. So such
a model's hit may load inline (in the step that computes the request) only when no eviction can
happen before its load. ``RoomLedger`` decides that from what both sides know:

- the worker reports, with step ``s``'s output, how many more entries (each counted as the
  largest entry the connector stores) its top tier takes without evicting anything after step
  ``s`` (``KVTierWorkerMetadata.room``, measured before that report's store events are taken, so
  every eviction before the measurement is in the mirror);
- the scheduler counts, per step it planned and has not yet seen reported, the entries that step
  may add (one per save spec), and, per background load until the worker reports it finished,
  one per chunk and group it may promote.

An eviction needs a put that finds no room; if the reported room covers every entry that can
still be put before the load, none can happen. The worker copies a step's inline loads before it
starts that step's background loads, so the step being planned adds nothing before its own
inline loads. Pure bookkeeping: no threads, no I/O; the scheduler's loop is its only caller.
"""

from __future__ import annotations


class RoomLedger:
    """The room the worker's top tier has left against the entries planned since it was measured
    (see the module docstring)."""

    def __init__(self) -> None:
        self._room: int | None = None  # entries the top tier took without evicting, after step _seen
        self._seen = -1  # the last step the worker reported
        self._planned: dict[int, int] = {}  # step -> entries it may add (not yet reported)
        self._loading: dict[str, int] = {}  # request -> entries its background load may promote

    def planned(self, step: int, entries: int) -> None:
        """Step ``step`` (built now, reported later) may put ``entries`` entries."""
        if entries > 0 and step > self._seen:
            self._planned[step] = self._planned.get(step, 0) + entries

    def loading(self, req_id: str, entries: int) -> None:
        """A background load of ``req_id`` may promote up to ``entries`` entries until it ends."""
        self._loading[req_id] = self._loading.get(req_id, 0) + entries

    def loaded(self, req_ids) -> None:
        """The worker reported these requests' background loads ended (or failed)."""
        for req_id in req_ids or ():
            self._loading.pop(req_id, None)

    def reported(self, step: int, room: int | None) -> None:
        """The worker's room after step ``step`` (None: not known). Reports arrive in step
        order; a stale one is ignored."""
        if step < self._seen:
            return
        self._seen, self._room = step, room
        for done in [s for s in self._planned if s <= step]:
            del self._planned[done]

    def safe(self) -> bool:
        """True when nothing can be evicted from the top tier before the next step's loads."""
        if self._room is None:
            return False
        return self._room >= sum(self._planned.values()) + sum(self._loading.values())
