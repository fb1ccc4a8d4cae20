"""Per-request state slots for models with recurrent layers (LFM2's short convolutions).

Why a pool of its own: an attention layer's memory grows with the context, in blocks; a
recurrent layer's does not: it keeps a fixed-size state per request (a short convolution's last
kernel - 1 inputs of each channel), overwritten every step. So a request holds one slot, the same
index in every such layer's state tensor (the runner's), from its admission until it finishes, is
aborted or is preempted. A preempted request's state is dropped with its blocks: recompute runs
its tokens again from position 0 and rebuilds it. The pool holds `max_num_seqs` slots, so a
running request always finds one; the scheduler still asks before admitting.

Like the block pool it only decides indices; the tensors are the runner's.
"""
from __future__ import annotations


class StateSlots:
    """Slot indices handed to requests by id; lowest free index first (warm memory)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"{num_slots} state slots")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: pop() gives the lowest
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    def slot_of(self, request_id: str) -> int | None:
        return self._held.get(request_id)

    def can_take(self, request_id: str) -> bool:
        """Whether the request holds a slot or one is free for it."""
        return request_id in self._held or bool(self._free)

    def take(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it holds none; None when none is free."""
        slot = self._held.get(request_id)
        if slot is None and self._free:
            slot = self._held[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._free.sort(reverse=True)
