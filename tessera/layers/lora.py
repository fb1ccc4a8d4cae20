"""LoRA adapters beside a projection's own product, several adapters in one step.

The base weight stays as it is stored (any quantization) and shared; an adapter adds
`B (A x)` (its scale folded into B) to the rows that asked for it. A model with adapters
enabled has `max_loras` slots: `LoRASlots` holds, for the step being run, each row's slot
(-1: the base) and each slot's rank; each adapted `Linear` holds a `LoRATable`, the addresses of
each slot's A and B for that projection. The runner fills a slot when an adapter enters it
(pointers only: the adapter's tensors stay where they were loaded) and sets the rows' slots
before each forward, so a step of the base and three adapters is one kernel call per projection
(kernels/lora.c) instead of one set of operators per adapter.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from tessera.kernels import library, lora_ops


# Up to this many rows a step's updates go through kernels/lora.c: the decodes of many streams and
# small chunks, where one call reading each adapter's bfloat16 weights once beats a GEMM pair per
# adapter over float32 copies three times their size (16 streams over 4 adapters: 0.73x the base's
# throughput that way, against 0.87x). Larger prompt chunks are compute-bound, and PyTorch's BLAS
# does them 3x faster than the kernel's row blocks (Intel Xeon, no AVX512-BF16).
NATIVE_MAX_ROWS = 64
MAX_PARTS = 3  # a projection's parts: Q, K, V at most


class LoRASlots:
    """The step's row -> slot map and each slot's rank, shared by a model's adapted layers.
    `dtype`: the adapters' weights (bfloat16 or float32, whatever the activations' dtype)."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)
        self.row_slots: Optional[Tensor] = None  # int32 [rows]; None: no row uses an adapter this step
        self.native = library.available() is None and str(device) == "cpu"
        self._scratch = torch.empty(0, dtype=torch.float32)
        self.step_args: tuple = ()
        self.segments: list[tuple[int, int, int]] = []  # (slot, first row, end row): runs of one adapter

    @property
    def active(self) -> bool:
        return self.row_slots is not None

    def begin_step(self, row_slots: Optional[list[int]]) -> None:
        """Rows' slots for the coming forward (None or all -1: the base alone)."""
        if row_slots is None or all(s < 0 for s in row_slots):
            self.row_slots = None
            return
        self.row_slots = torch.tensor(row_slots, dtype=torch.int32)
        self.segments = []
        start = 0
        for i in range(1, len(row_slots) + 1):
            if i == len(row_slots) or row_slots[i] != row_slots[start]:
                if row_slots[start] >= 0:
                    self.segments.append((row_slots[start], start, i))
                start = i
        width = MAX_PARTS * self.max_rank
        if self._scratch.numel() < len(row_slots) * width:
            self._scratch = torch.empty(len(row_slots) * width, dtype=torch.float32)
        # What every projection's kernel call passes this step, as addresses taken once.
        self.step_args = (self.row_slots.data_ptr(), self.ranks.data_ptr(), self.max_loras,
                          self._scratch.data_ptr(), width)


class LoRATable:
    """One projection's adapters by slot. `output_sizes`: its parts (Q, K, V or gate, up)."""

    def __init__(self, slots: LoRASlots, output_sizes: list[int]) -> None:
        self.slots = slots
        self.num_parts = len(output_sizes)
        self.part_ends = torch.tensor(output_sizes, dtype=torch.int64).cumsum(0)
        self.a_ptrs = torch.zeros(slots.max_loras, dtype=torch.int64)
        self.b_ptrs = torch.zeros(slots.max_loras, dtype=torch.int64)
        # What every kernel call passes for this projection (lora.c; the C decode step keeps them too).
        self.addresses = (self.a_ptrs.data_ptr(), self.b_ptrs.data_ptr(), self.part_ends.data_ptr(), self.num_parts)
        self._held: list[Optional[tuple[Tensor, Tensor]]] = [None] * slots.max_loras
        self._dense_cache: list[Optional[tuple[Tensor, Tensor]]] = [None] * slots.max_loras

    def put(self, slot: int, weights: Optional[tuple[Tensor, Tensor]]) -> None:
        """Slot `slot` now holds (At [in, P * r], Bt [r, out]: A and B transposed) for this projection, in
        the slots' dtype, or nothing (the adapter leaves it alone: its rows get the base product)."""
        assert weights is None or (weights[0].dtype == weights[1].dtype == self.slots.dtype)
        self._held[slot] = weights
        self._dense_cache[slot] = None
        self.a_ptrs[slot] = 0 if weights is None else weights[0].data_ptr()
        self.b_ptrs[slot] = 0 if weights is None else weights[1].data_ptr()

    def add_to(self, x: Tensor, y: Tensor) -> None:
        """y += each adapted row's update, in place; x [M, in] and y [M, out] rows of this step."""
        slots = self.slots
        rows = slots.row_slots
        assert rows is not None and rows.shape[0] == x.shape[0], "LoRA rows do not match the step"
        if slots.native and x.shape[0] <= NATIVE_MAX_ROWS and x.dtype == y.dtype \
                and x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1 and y.stride(1) == 1:
            rows_p, ranks_p, num_slots, scratch_p, width = slots.step_args
            a_p, b_p, ends_p, parts = self.addresses
            lora_ops.lora_add(x, y, rows_p, a_p, b_p, ranks_p, num_slots, ends_p, parts, scratch_p, width,
                             slots.dtype == torch.bfloat16)
            return
        self._add_grouped(x, y)

    def _dense(self, slot: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Slot `slot`'s At [in, P * r] and its B as one block-diagonal [P * r, out] in `dtype`, for
        PyTorch's products (made at first use, dropped when the slot changes hands)."""
        cached = self._dense_cache[slot]
        if cached is None or cached[0].dtype != dtype:
            a, bt = self._held[slot]
            r, ends = a.shape[1] // self.num_parts, [0] + self.part_ends.tolist()
            full = torch.zeros(a.shape[1], bt.shape[1], dtype=dtype, device=bt.device)
            for p in range(self.num_parts):
                full[p * r:(p + 1) * r, ends[p]:ends[p + 1]] = bt[:, ends[p]:ends[p + 1]]
            cached = self._dense_cache[slot] = (a.to(dtype), full)
        return cached

    def _add_grouped(self, x: Tensor, y: Tensor) -> None:
        """The same with PyTorch's products, a GEMM pair per run of one adapter's rows (the runner
        puts each adapter's rows together): many rows, where the BLAS beats the kernel's row
        blocks, GPUs, and the kernel's reference in the tests."""
        for slot, a, b in self.slots.segments:
            if self._held[slot] is None:
                continue
            at, full = self._dense(slot, x.dtype)
            y[a:b].addmm_(x[a:b] @ at, full)
