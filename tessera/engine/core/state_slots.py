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


class StateSnapshots:
    """Copies of requests' states at block boundaries, by the chained hash of the block that ends
    there, so a prefix-cache hit resumes from the state of the tokens it skips (vLLM keeps Mamba
    states per block for the same reason). A request leaves one: at the last full block of its
    prompt short of its last token (where a repeat of the prompt, or a longer one extending it,
    hits). Snapshot k is row `first_row + k` of every state tensor (the runner's, after the
    request slots); the least recently used one is overwritten when all are taken."""

    def __init__(self, num_snapshots: int, first_row: int) -> None:
        self.num_snapshots, self.first_row = num_snapshots, first_row
        self._rows: dict[int, int] = {}  # block hash -> row; insertion order is recency
        self._free = list(range(first_row + num_snapshots - 1, first_row - 1, -1))

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, block_hash: int) -> int | None:
        """The snapshot's row, marked used (None: no snapshot at that block)."""
        row = self._rows.pop(block_hash, None)
        if row is not None:
            self._rows[block_hash] = row
        return row

    def has(self, block_hash: int) -> bool:
        return block_hash in self._rows

    def take(self, block_hash: int) -> int:
        """A row for a new snapshot at `block_hash` (its own if it has one), evicting the least
        recently used snapshot when none is free."""
        row = self.row(block_hash)
        if row is not None:
            return row
        if self._free:
            row = self._free.pop()
        else:
            oldest = next(iter(self._rows))
            row = self._rows.pop(oldest)
        self._rows[block_hash] = row
        return row
