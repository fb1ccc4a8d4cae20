"""The vision encoder's outputs for a step's images, and where they go in the packed batch.

An image is encoded once, the first time a prefill chunk reaches its placeholder run, and its
output (one embedding per placeholder) is kept for the request until it finishes: a chunk
boundary inside the run, or a preemption that recomputes the prompt, reads the kept rows
instead of running the encoder again. A small LRU keyed by the image's content hash serves the
same image in later requests (a conversation sends its images again every turn).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor

from tessera.engine.core.scheduler_output import ScheduledChunk
from tessera.vision import ImageInput

# Encoder outputs kept across requests: a LLaVA-1.5 image is 576 x 4,096 bfloat16 values (4.5 MiB).
DEFAULT_CACHED_IMAGES = 16


class ImageEmbeddings:
    """Encoder outputs per request (until it finishes) and by content hash (LRU)."""

    def __init__(self, encode: Callable[[Tensor], Tensor], device: torch.device,
                 max_cached: int = DEFAULT_CACHED_IMAGES) -> None:
        self.encode = encode  # pixels [B, C, H, W] -> embeddings [B, tokens, hidden]
        self.device = device
        self.max_cached = max_cached
        self.by_hash: OrderedDict[str, Tensor] = OrderedDict()
        self.held: dict[str, dict[str, Tensor]] = {}  # request id -> image hash -> its embeddings
        self.num_encoded = 0  # images run through the encoder (a test reads it)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.held.pop(rid, None)

    def rows(self, placed: list[tuple[int, ScheduledChunk]]) -> tuple[Tensor, Tensor]:
        """(packed rows, their embeddings) for the image placeholders among the chunks, each given
        with its first row in the packed batch; the images not yet encoded are encoded together."""
        self._encode_missing([(c.request_id, im) for _, c in placed for im in c.images])
        rows: list[Tensor] = []
        values: list[Tensor] = []
        for first_row, c in placed:
            end = c.start + c.num_new_tokens
            for im in c.images:
                lo, hi = max(c.start, im.offset), min(end, im.offset + im.length)
                rows.append(torch.arange(first_row + lo - c.start, first_row + hi - c.start))
                values.append(self.held[c.request_id][im.hash][lo - im.offset:hi - im.offset])
        return torch.cat(rows).to(self.device), torch.cat(values)

    def _encode_missing(self, wanted: list[tuple[str, ImageInput]]) -> None:
        todo: dict[str, ImageInput] = {}
        for rid, im in wanted:
            mine = self.held.setdefault(rid, {})
            if im.hash in mine:
                continue
            hit = self.by_hash.get(im.hash)
            if hit is not None:
                self.by_hash.move_to_end(im.hash)
                mine[im.hash] = hit
            else:
                todo.setdefault(im.hash, im)
        if not todo:
            return
        images = list(todo.values())
        pixels = torch.stack([torch.frombuffer(bytearray(im.pixels), dtype=torch.float32).view(*im.shape)
                              for im in images]).to(self.device)
        out = self.encode(pixels)
        self.num_encoded += len(images)
        encoded: dict[str, Tensor] = {}
        for im, emb in zip(images, out):
            if emb.shape[0] != im.length:
                raise RuntimeError(f"the encoder gave {emb.shape[0]} embeddings for an image of {im.length} "
                                   "placeholders")
            encoded[im.hash] = self.by_hash[im.hash] = emb
            while len(self.by_hash) > self.max_cached:
                self.by_hash.popitem(last=False)
        for rid, im in wanted:
            self.held[rid].setdefault(im.hash, encoded.get(im.hash))
