"""A second tier for the prefix cache: full KV blocks in files, by hash, surviving restarts.

Recomputing a 2,000-token conversation costs seconds of prefill on a CPU; reading its
blocks back costs milliseconds. Blocks are written through when they enter the RAM prefix
cache (a copy is taken on the engine thread, the file is written by a background thread),
so whatever the RAM cache evicts, and whatever a stopped server held, can be found again.
A prefix lookup that ends in RAM continues here; blocks found are verified and loaded into
fresh blocks instead of being recomputed.

Files live in `<dir>/<fingerprint>/`, the fingerprint a digest of everything that decides
the bytes of a block (the model file's sha256, compute dtype, cache format, block size,
layer and head shapes, the hash scheme). Each file repeats the fingerprint, its block hash,
its length and a checksum of its payload; a file that disagrees (foreign, truncated,
corrupt) is skipped with a warning and never loaded. The tier's size is bounded: the least
recently used files go first.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

MAGIC = b"TSKVBLK1"
HEADER = struct.Struct("<8s16sQQ16s")  # magic, fingerprint, block hash, payload bytes, payload digest
SUFFIX = ".kvb"


def fingerprint_of(fields: dict) -> bytes:
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).digest()


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass
class TierStats:
    hits_blocks: int = 0  # blocks loaded instead of recomputed
    misses_rejected: int = 0  # files found but refused (foreign, corrupt, truncated)
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_evicted: int = 0  # files removed to stay under the size limit
    load_seconds: float = 0.0
    write_queue_dropped: int = 0


class DiskKVTier:
    """Blocks by hash under `root`, at most `max_bytes` of files. Thread-safe for one engine thread
    (lookups, reads, submissions) and the tier's own writer thread."""

    def __init__(self, root: Path, max_bytes: int, fields: dict, block_bytes: int,
                 max_pending_bytes: int = 256 << 20) -> None:
        self.fingerprint = fingerprint_of(fields)
        self.dir = Path(root) / self.fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        self.file_bytes = HEADER.size + block_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file size, least recently used first
        self._total = 0  # bytes of the files in the index
        self._pending: set[int] = set()
        self._pending_bytes = 0
        self._max_pending_bytes = max_pending_bytes
        meta = self.dir / "tier.json"
        if not meta.exists():
            meta.write_text(json.dumps(fields, indent=1, sort_keys=True))
        self._scan()
        self._queue: "queue.Queue[Optional[tuple[list[int], bytes]]]" = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="tessera-kv-offload", daemon=True)
        self._writer.start()
        logger.info("KV offload tier %s: %d blocks on disk (%.0f MiB of %.0f MiB)", self.dir, len(self._index),
                    self.disk_bytes / 2**20, max_bytes / 2**20)

    # -- index ------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                h = int(path.stem, 16)
                st = path.stat()
            except (ValueError, OSError):
                logger.warning("KV offload: ignoring %s (not a block file name)", path.name)
                continue
            if st.st_size != self.file_bytes:
                logger.warning("KV offload: ignoring %s (%d bytes, a block file here has %d)", path.name,
                               st.st_size, self.file_bytes)
                continue
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self._index[h] = size
            self._total += size

    @property
    def disk_bytes(self) -> int:
        return self._total

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"

    # -- reads (engine thread) ----------------------------------------------
    def read(self, block_hash: int) -> Optional[bytes]:
        """The block's payload if its file is there and intact, else None (with a warning if refused)."""
        t0 = time.perf_counter()
        with self._lock:
            known = block_hash in self._index
            pending = block_hash in self._pending
        if pending:
            self.flush()  # written in a moment: wait rather than recompute
            known = True
        if not known:
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:
            self._forget(block_hash)
            return None
        why = self._check(data, block_hash)
        if why is not None:
            logger.warning("KV offload: refusing %s (%s); it will be recomputed", path.name, why)
            self.stats.misses_rejected += 1
            self._forget(block_hash)
            return None
        with self._lock:
            self._index.move_to_end(block_hash)
        self.stats.bytes_read += len(data)
        self.stats.hits_blocks += 1
        self.stats.load_seconds += time.perf_counter() - t0
        return data[HEADER.size:]

    def _check(self, data: bytes, block_hash: int) -> Optional[str]:
        if len(data) != self.file_bytes:
            return f"{len(data)} bytes, expected {self.file_bytes}"
        magic, fp, h, n, digest = HEADER.unpack_from(data)
        if magic != MAGIC:
            return "not a Tessera block file"
        if fp != self.fingerprint:
            return "written for another model or cache format"
        if h != block_hash & 0xFFFFFFFFFFFFFFFF:
            return "holds another block"
        if n != self.block_bytes:
            return "wrong payload length"
        if _digest(data[HEADER.size:]) != digest:
            return "checksum mismatch"
        return None

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            self._total -= self._index.pop(block_hash, 0)

    # -- writes -------------------------------------------------------------
    def submit(self, hashes: list[int], payloads: bytes) -> None:
        """Queue blocks (payloads: len(hashes) * block_bytes, in order) for writing; returns at once.
        Past `max_pending_bytes` of unwritten data the blocks are dropped (counted), never blocking."""
        with self._lock:
            fresh = [i for i, h in enumerate(hashes) if h not in self._index and h not in self._pending]
            if not fresh:
                return
            if self._pending_bytes + len(fresh) * self.block_bytes > self._max_pending_bytes:
                self.stats.write_queue_dropped += len(fresh)
                return
            self._pending.update(hashes[i] for i in fresh)
            self._pending_bytes += len(fresh) * self.block_bytes
        bb = self.block_bytes
        self._queue.put(([hashes[i] for i in fresh], b"".join(payloads[i * bb:(i + 1) * bb] for i in fresh)))

    def flush(self) -> None:
        """Wait until every submitted block is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                hashes, payloads = item
                bb = self.block_bytes
                for i, h in enumerate(hashes):
                    payload = payloads[i * bb:(i + 1) * bb]
                    self._write_one(h, payload)
            except Exception:  # a full or failing disk must not kill serving: the tier just misses
                logger.exception("KV offload: writing blocks failed")
            finally:
                if item is not None:
                    with self._lock:
                        for h in item[0]:
                            self._pending.discard(h)
                        self._pending_bytes -= len(item[0]) * self.block_bytes
                self._queue.task_done()

    def _write_one(self, block_hash: int, payload: bytes) -> None:
        header = HEADER.pack(MAGIC, self.fingerprint, block_hash & 0xFFFFFFFFFFFFFFFF, len(payload),
                             _digest(payload))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)  # readers never see half a file
        with self._lock:
            self._total += self.file_bytes - self._index.pop(block_hash, 0)
            self._index[block_hash] = self.file_bytes
            victims = []
            while self._total > self.max_bytes and len(self._index) > 1:
                old, size = self._index.popitem(last=False)
                victims.append(old)
                self._total -= size
        for old in victims:
            try:
                self._path(old).unlink()
            except OSError:
                pass
        self.stats.blocks_evicted += len(victims)
        self.stats.bytes_written += self.file_bytes
        self.stats.blocks_written += 1
