"""Files and batches in SQLite (`$TESSERA_HOME/batches.sqlite3`), so a batch outlives the server.

Each line of a batch is a row whose `result` is written, in its own transaction, when its answer
comes back: after a restart (a crash or SIGKILL included) the runner reruns exactly the lines
without one, so no answer is lost or recorded twice. The output and error files are built from
those rows when the batch ends. Owners are API key names ("" on a server without keys): a key
sees only its own files and batches.

Calls come from the server's event loop; a lock keeps the one connection safe if another thread
ever calls in. Writes are small (a line's result), in WAL mode.
"""
from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from tessera.server.batches.protocol import ACTIVE, BatchLine, LineError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, model TEXT,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    errors TEXT, metadata TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, in_progress_at INTEGER, expires_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    result TEXT, failed INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, line));
CREATE INDEX IF NOT EXISTS lines_pending ON lines (batch_id, result);
"""
# Timestamp columns a status change may set.
_TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
               "cancelled_at")
WINDOW_SECONDS = {"24h": 24 * 3600}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class BatchStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # a process kill loses nothing committed
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _one(self, sql: str, args: Iterable[Any] = ()) -> Optional[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchone()

    def _all(self, sql: str, args: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # -- files ----------------------------------------------------------------------------
    def add_file(self, owner: str, filename: str, purpose: str, content: bytes) -> sqlite3.Row:
        fid = new_id("file-")
        with self._lock:
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (fid, owner, filename, purpose, len(content), int(time.time()), content))
        row = self.get_file(fid, owner)
        assert row is not None
        return row

    def get_file(self, fid: str, owner: str) -> Optional[sqlite3.Row]:
        return self._one("SELECT id, owner, filename, purpose, bytes, created_at FROM files WHERE id = ? AND owner = ?",
                         (fid, owner))

    def file_content(self, fid: str, owner: str) -> Optional[bytes]:
        row = self._one("SELECT content FROM files WHERE id = ? AND owner = ?", (fid, owner))
        return None if row is None else bytes(row["content"])

    def list_files(self, owner: str, purpose: Optional[str], limit: int) -> list[sqlite3.Row]:
        sql = "SELECT id, owner, filename, purpose, bytes, created_at FROM files WHERE owner = ?"
        args: list[Any] = [owner]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        return self._all(sql + " ORDER BY created_at DESC, rowid DESC LIMIT ?", [*args, limit])

    def delete_file(self, fid: str, owner: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (fid, owner)).rowcount > 0

    # -- batches --------------------------------------------------------------------------
    def create_batch(self, owner: str, endpoint: str, input_file_id: str, window: str,
                     metadata: Optional[dict[str, str]], lines: list[BatchLine],
                     errors: list[LineError]) -> sqlite3.Row:
        """A batch over checked `lines`, in progress; or failed with `errors` (no line runs)."""
        bid, now = new_id("batch_"), int(time.time())
        model = next((ln.body.get("model") for ln in lines if isinstance(ln.body.get("model"), str)), None)
        status = "failed" if errors else "in_progress"
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO batches (id, owner, endpoint, model, input_file_id, completion_window, status, errors, "
                "metadata, created_at, in_progress_at, expires_at, failed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (bid, owner, endpoint, model, input_file_id, window, status,
                 json.dumps([e.to_json() for e in errors]) if errors else None,
                 json.dumps(metadata) if metadata else None, now, None if errors else now,
                 now + WINDOW_SECONDS[window], now if errors else None))
            if not errors:
                self._db.executemany("INSERT INTO lines (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                                     ((bid, ln.line, ln.custom_id, json.dumps(ln.body)) for ln in lines))
            self._db.execute("COMMIT")
        row = self.get_batch(bid, owner)
        assert row is not None
        return row

    def get_batch(self, bid: str, owner: Optional[str]) -> Optional[sqlite3.Row]:
        """The batch `bid` of `owner` (None: whoever owns it)."""
        if owner is None:
            return self._one("SELECT * FROM batches WHERE id = ?", (bid,))
        return self._one("SELECT * FROM batches WHERE id = ? AND owner = ?", (bid, owner))

    def list_batches(self, owner: str, limit: int, after: Optional[str]) -> list[sqlite3.Row]:
        """Newest first; `after`: the page after that batch id."""
        if after is not None:
            anchor = self._one("SELECT rowid FROM batches WHERE id = ? AND owner = ?", (after, owner))
            if anchor is not None:
                return self._all("SELECT * FROM batches WHERE owner = ? AND rowid < ? ORDER BY rowid DESC LIMIT ?",
                                 (owner, anchor["rowid"], limit))
        return self._all("SELECT * FROM batches WHERE owner = ? ORDER BY rowid DESC LIMIT ?", (owner, limit))

    def active_batches(self) -> list[sqlite3.Row]:
        """Batches with work left, oldest first (the runner takes them in that order)."""
        marks = ", ".join("?" for _ in ACTIVE)
        return self._all(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY rowid", ACTIVE)

    def counts(self, bid: str) -> tuple[int, int, int]:
        """(total, completed, failed) lines."""
        row = self._one("SELECT COUNT(*) AS total, COUNT(result) - SUM(failed) AS done, SUM(failed) AS failed "
                        "FROM lines WHERE batch_id = ?", (bid,))
        assert row is not None
        return row["total"], row["done"] or 0, row["failed"] or 0

    def set_status(self, bid: str, status: str, stamp: Optional[str] = None) -> None:
        """Move a batch to `status`, setting the timestamp column `stamp` to now."""
        assert stamp is None or stamp in _TIMESTAMPS
        with self._lock:
            if stamp is None:
                self._db.execute("UPDATE batches SET status = ? WHERE id = ?", (status, bid))
            else:
                self._db.execute(f"UPDATE batches SET status = ?, {stamp} = ? WHERE id = ?",
                                 (status, int(time.time()), bid))

    # -- lines ----------------------------------------------------------------------------
    def pending_lines(self, bid: str, skip: set[int], limit: int) -> list[sqlite3.Row]:
        """Lines of `bid` without a result, in file order, but those in `skip` (running now)."""
        rows = self._all("SELECT line, custom_id, body FROM lines WHERE batch_id = ? AND result IS NULL "
                         "ORDER BY line LIMIT ?", (bid, limit + len(skip)))
        return [r for r in rows if r["line"] not in skip][:limit]

    def record(self, bid: str, line: int, result: dict[str, Any], failed: bool) -> None:
        """A line's answer (its output or error file entry); a line answered already keeps its first."""
        with self._lock:
            self._db.execute("UPDATE lines SET result = ?, failed = ? WHERE batch_id = ? AND line = ? AND result IS NULL",
                             (json.dumps(result), int(failed), bid, line))

    def finish(self, bid: str, status: str, stamp: str) -> None:
        """Write the output and error files from the lines answered, and end the batch in `status`."""
        assert stamp in _TIMESTAMPS
        row = self.get_batch(bid, None)
        assert row is not None
        rows = self._all("SELECT result, failed FROM lines WHERE batch_id = ? AND result IS NOT NULL ORDER BY line",
                         (bid,))
        out = "".join(r["result"] + "\n" for r in rows if not r["failed"]).encode()
        err = "".join(r["result"] + "\n" for r in rows if r["failed"]).encode()
        out_id = self.add_file(row["owner"], f"{bid}_output.jsonl", "batch_output", out)["id"] if out else None
        err_id = self.add_file(row["owner"], f"{bid}_error.jsonl", "batch_output", err)["id"] if err else None
        with self._lock:
            self._db.execute(f"UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, {stamp} = ? "
                             "WHERE id = ?", (status, out_id, err_id, int(time.time()), bid))
