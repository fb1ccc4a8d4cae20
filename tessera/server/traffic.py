"""Traffic traces: what `tessera serve --record-traffic PATH` writes and `tessera bench replay` reads.

A trace is JSON Lines. The first line is a header, every later line one engine request (a
completions request with several prompts gives one line per prompt):

    {"format": "tessera-traffic", "version": 1, "created": "2026-...Z", "record_text": false}
    {"t": 1764612345.123, "endpoint": "chat", "model": "smollm2-135m", "prompt_tokens": 412,
     "output_tokens": 96, "max_tokens": 128, "n": 1, "stream": true, "status": 200,
     "finish_reason": "length", "latency_s": 2.31, "ttft_s": 0.21, "cached_tokens": 384,
     "block_size": 16, "prefix_hashes": ["9f1c...", ...], "sampling": {"temperature": 0.7, ...}}

`prefix_hashes` are the chained hashes of the prompt's full blocks of `block_size` token ids
(hash i covers tokens [0, (i + 1) * block_size)), the prefix cache's own chain, so requests
that share a head share the leading hashes and a later turn of a conversation extends the
earlier turn's chain: replay reproduces prefix sharing and multi-turn structure without the
text. Prompt and output text are recorded only with --record-text (`text`). Times are seconds,
`t` the arrival on the wall clock (UNIX time). A request refused before it ran (429, 400) is
recorded with its status and `error`, and `output_tokens` 0.

Recording never slows a request: the handler puts a small record on a bounded queue (dropping
it, and counting the drop, if the writer has fallen behind) and a writer thread hashes,
tokenizes refused text prompts, serialises and appends. The file rotates by size like a log:
PATH becomes PATH.1 (PATH.1 becomes PATH.2, ...), keeping `keep` old files, each new file
starting with its own header, so every file is a valid trace alone.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from tessera.engine.core.block_pool import hash_block
from tessera.errors import TesseraError

FORMAT = "tessera-traffic"
VERSION = 1
ENDPOINTS = ("completions", "chat")
logger = logging.getLogger("tessera.server.traffic")

# field -> (types accepted, required)
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "t": ((int, float), True),
    "endpoint": ((str,), True),
    "model": ((str,), True),
    "prompt_tokens": ((int,), True),
    "output_tokens": ((int,), True),
    "prefix_hashes": ((list,), True),
    "block_size": ((int,), True),
    "stream": ((bool,), True),
    "status": ((int,), True),
    "max_tokens": ((int, type(None)), False),
    "n": ((int,), False),
    "finish_reason": ((str, type(None)), False),
    "latency_s": ((int, float, type(None)), False),
    "ttft_s": ((int, float, type(None)), False),
    "cached_tokens": ((int,), False),
    "sampling": ((dict,), False),
    "error": ((str,), False),
    "text": ((dict,), False),
}
REQUIRED_FIELDS = tuple(name for name, (_, required) in _FIELDS.items() if required)


class TraceError(TesseraError):
    """A trace file that cannot be replayed: not a trace, a newer format, or a bad line."""

    exit_code = 2


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """The chained hashes of the full blocks of `token_ids` (hash_block's chain, as the prefix
    cache computes it without a model salt), as 16 hex digits each."""
    out: list[str] = []
    parent: Optional[int] = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(f"{parent:016x}")
    return out


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace, as replay needs it (the rest of the line is in `raw`)."""

    t: float
    endpoint: str
    model: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: Optional[int]
    prefix_hashes: tuple[str, ...]
    block_size: int
    stream: bool
    status: int
    cached_tokens: Optional[int] = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == 200


def header(record_text: bool) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "record_text": record_text}


def _check_header(line: str, where: str) -> dict[str, Any]:
    try:
        head = json.loads(line)
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{where}: not a Tessera traffic trace (its first line must be a header "
                         f'{{"format": "{FORMAT}", "version": {VERSION}, ...}}); for the Azure LLM '
                         "inference trace CSV, give the .csv file")
    version = head.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TraceError(f"{where}: header has no valid format version ({version!r})")
    if version > VERSION:
        raise TraceError(f"{where}: trace format version {version} is newer than this Tessera reads "
                         f"(up to {VERSION}); upgrade Tessera to replay it")
    return head


def parse_record(obj: Any, where: str) -> TraceRecord:
    """A trace line's object checked field by field; TraceError names the line and the field."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a record must be a JSON object, not {type(obj).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    for name, (types, _) in _FIELDS.items():
        if name in obj:
            value = obj[name]
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                names = "/".join("null" if t is type(None) else t.__name__ for t in types)
                raise TraceError(f"{where}: field {name!r} must be {names}, not {value!r}")
    if obj["endpoint"] not in ENDPOINTS:
        raise TraceError(f"{where}: endpoint must be one of {', '.join(ENDPOINTS)}, not {obj['endpoint']!r}")
    for name in ("prompt_tokens", "output_tokens", "block_size"):
        if obj[name] < (1 if name == "block_size" else 0):
            raise TraceError(f"{where}: field {name!r} must not be {'below 1' if name == 'block_size' else 'negative'}")
    hashes = obj["prefix_hashes"]
    if any(not isinstance(h, str) or not h for h in hashes):
        raise TraceError(f"{where}: prefix_hashes must be a list of hex strings")
    if len(hashes) > obj["prompt_tokens"] // obj["block_size"]:
        raise TraceError(f"{where}: {len(hashes)} prefix hashes for {obj['prompt_tokens']} prompt tokens "
                         f"in blocks of {obj['block_size']}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and max_tokens < 0:
        raise TraceError(f"{where}: field 'max_tokens' must not be negative")
    return TraceRecord(t=float(obj["t"]), endpoint=obj["endpoint"], model=obj["model"],
                       prompt_tokens=obj["prompt_tokens"], output_tokens=obj["output_tokens"],
                       max_tokens=max_tokens, prefix_hashes=tuple(hashes), block_size=obj["block_size"],
                       stream=obj["stream"], status=obj["status"], cached_tokens=obj.get("cached_tokens"),
                       raw=obj)


@dataclass
class Trace:
    records: list[TraceRecord]
    headers: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)  # why lines were left out (skip_invalid)

    @property
    def duration(self) -> float:
        return self.records[-1].t - self.records[0].t if self.records else 0.0


def read_trace(paths: Union[str, Path, Iterable[Union[str, Path]]], skip_invalid: bool = False) -> Trace:
    """Records of one or more trace files (rotated parts, any order), sorted by arrival.

    Refuses, naming the file and line: a file that is not a trace, a newer format version, a line
    that is not JSON or misses or mistypes a field, with `skip_invalid` those lines are left out
    (and listed in `skipped`) instead. An empty trace is refused either way."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records: list[TraceRecord] = []
    headers: list[dict[str, Any]] = []
    skipped: list[str] = []
    for path in map(Path, paths):
        try:
            f = open(path, encoding="utf-8", errors="strict")
        except OSError as exc:
            raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
        with f:
            try:
                lines = f.read().splitlines()
            except UnicodeDecodeError:
                raise TraceError(f"{path}: not a Tessera traffic trace (not UTF-8 text)") from None
        if not lines:
            raise TraceError(f"{path}: empty file, not a Tessera traffic trace")
        headers.append(_check_header(lines[0], f"{path}, line 1"))
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise TraceError(f"{where}: not JSON ({exc.msg})") from None
                records.append(parse_record(obj, where))
            except TraceError as exc:
                if not skip_invalid:
                    raise
                skipped.append(str(exc))
    if not records:
        raise TraceError(f"no requests in {', '.join(map(str, paths))}")
    records.sort(key=lambda r: r.t)
    return Trace(records, headers, skipped)


def prefix_hit_rate(records: Sequence[TraceRecord]) -> Optional[float]:
    """Share of prompt tokens in blocks an earlier request's prompt already had (in arrival
    order): the hit rate of an unbounded prefix cache, a property of the traffic alone. None
    for a trace without prompt tokens."""
    seen: set[str] = set()
    hit = total = 0
    for r in records:
        run = 0
        while run < len(r.prefix_hashes) and r.prefix_hashes[run] in seen:
            run += 1
        hit += run * r.block_size
        total += r.prompt_tokens
        seen.update(r.prefix_hashes)
    return hit / total if total else None


# ----------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class RecordSettings:
    """`--record-traffic PATH`, `--record-text`, `--record-traffic-max-size`, `--record-traffic-keep`."""

    path: Path
    record_text: bool = False
    max_bytes: int = 256 << 20
    keep: int = 5
    queue_size: int = 10_000

    def __post_init__(self) -> None:
        from tessera.errors import ConfigError

        if self.max_bytes < 4096:
            raise ConfigError(f"--record-traffic-max-size must be at least 4KiB, not {self.max_bytes}")
        if self.keep < 0:
            raise ConfigError(f"--record-traffic-keep must be >= 0, not {self.keep}")
        if self.path.is_dir():
            raise ConfigError(f"--record-traffic {self.path} is a folder; give a file path")


@dataclass
class Pending:
    """What a handler hands over about one finished (or refused) engine request: raw facts only;
    the writer thread turns them into a record."""

    arrival: float
    endpoint: str
    model: str
    prompt: Union[str, list[int]]
    stream: bool
    status: int
    block_size: int
    params: Any  # SamplingParams
    output_tokens: int = 0
    finish_reason: Optional[str] = None
    finished_at: float = field(default_factory=time.time)
    ttft_s: Optional[float] = None
    cached_tokens: Optional[int] = None
    error: Optional[str] = None
    tokenize: Optional[Callable[[str], list[int]]] = None  # for a text prompt refused before the engine
    decode: Optional[Callable[..., str]] = None  # the prompt's text from its ids (--record-text)
    text: Optional[dict[str, Any]] = None  # only with --record-text


def sampling_summary(params: Any) -> dict[str, Any]:
    """The sampling settings that change a request's cost or length (no texts: stop strings and
    grammars are counted, not kept)."""
    out: dict[str, Any] = {"temperature": params.temperature}
    for name, default in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("ignore_eos", False),
                          ("logprobs", None), ("seed", None), ("speculative", True)):
        value = getattr(params, name, default)
        if value != default:
            out[name] = value
    stop = params.stop
    if stop:
        out["num_stop"] = 1 if isinstance(stop, str) else len(stop)
    so = params.structured_outputs
    if so is not None:
        out["structured"] = next((k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                                  if getattr(so, k, None)), "yes")
    return out


def make_record(p: Pending) -> dict[str, Any]:
    ids = p.prompt if isinstance(p.prompt, list) else (p.tokenize(p.prompt) if p.tokenize else [])
    params = p.params
    rec: dict[str, Any] = {
        "t": round(p.arrival, 6), "endpoint": p.endpoint, "model": p.model, "prompt_tokens": len(ids),
        "output_tokens": p.output_tokens, "max_tokens": getattr(params, "max_tokens", None),
        "n": getattr(params, "n", 1), "stream": p.stream, "status": p.status, "finish_reason": p.finish_reason,
        "latency_s": round(max(0.0, p.finished_at - p.arrival), 6),
        "ttft_s": None if p.ttft_s is None else round(p.ttft_s, 6),
        "block_size": p.block_size, "prefix_hashes": prefix_hashes(ids, p.block_size),
    }
    if p.cached_tokens is not None:
        rec["cached_tokens"] = p.cached_tokens
    if params is not None:
        rec["sampling"] = sampling_summary(params)
    if p.error:
        rec["error"] = p.error
    if p.text is not None:
        text = dict(p.text)
        if text.get("prompt") is None and p.decode is not None:
            text["prompt"] = p.decode(ids, skip_special_tokens=False)
        rec["text"] = text
    return rec


class TrafficRecorder:
    """The bounded queue and the writer thread behind --record-traffic."""

    def __init__(self, settings: RecordSettings) -> None:
        self.settings = settings
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[Optional[Pending]] = queue.Queue(maxsize=settings.queue_size)
        settings.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self._open()
        self._thread = threading.Thread(target=self._run, name="tessera-traffic", daemon=True)
        self._thread.start()

    @property
    def record_text(self) -> bool:
        return self.settings.record_text

    def _open(self):
        """Append to PATH (a new file gets a header; an existing trace keeps its own)."""
        path = self.settings.path
        try:
            fresh = not path.exists() or path.stat().st_size == 0
            f = open(path, "a", encoding="utf-8")
        except OSError as exc:
            raise TesseraError(f"--record-traffic {path}: {exc.strerror or exc}") from None
        if fresh:
            f.write(json.dumps(header(self.settings.record_text)) + "\n")
            f.flush()
        return f

    def submit(self, pending: Pending) -> None:
        """From a handler (the event loop): never blocks; a full queue drops the record."""
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                logger.warning("traffic recorder behind: %d record(s) dropped so far", self.dropped)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                line = json.dumps(make_record(item), separators=(",", ":")) + "\n"
                self._rotate_if_needed(len(line))
                self._file.write(line)
                self._file.flush()
                self.written += 1
            except Exception:  # noqa: BLE001 - a bad record or a full disk must not kill the thread
                logger.exception("traffic recorder: could not write a record")

    def _rotate_if_needed(self, incoming: int) -> None:
        path, keep = self.settings.path, self.settings.keep
        if self._file.tell() + incoming <= self.settings.max_bytes:
            return
        self._file.close()
        if keep == 0:
            path.unlink(missing_ok=True)
        else:
            for i in range(keep - 1, 0, -1):
                older = path.with_name(f"{path.name}.{i}")
                if older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
            os.replace(path, path.with_name(f"{path.name}.1"))
        self._file = self._open()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._file.close()


def note_request(recorder: TrafficRecorder, *, arrival: float, endpoint: str, model: str, engine: Any,
                 prompts: Sequence[Union[str, list[int]]], params: Any, stream: bool, status: int,
                 finals: Optional[dict[int, Any]] = None, error: Optional[str] = None) -> None:
    """Queue one record per prompt of an API request that ended (`finals`: its final
    RequestOutputs by prompt index, when it ran). Runs on the event loop: no hashing, no
    tokenizing, no I/O here, only references handed to the writer thread."""
    finals = finals or {}
    config = getattr(engine, "config", None)
    block_size = int(getattr(config, "block_size", 16))
    tokenizer = getattr(engine, "tokenizer", None)
    now = time.time()
    for index, prompt in enumerate(prompts):
        out = finals.get(index)
        ids = out.prompt_token_ids if out is not None else prompt
        choices = out.outputs if out is not None else []
        metrics = getattr(out, "metrics", None)
        first = getattr(metrics, "first_token_time", None)
        text = None
        if recorder.record_text:
            text = {"prompt": prompt if isinstance(prompt, str) else None,
                    "outputs": [c.text for c in sorted(choices, key=lambda c: c.index)]}
        recorder.submit(Pending(
            arrival=arrival, endpoint=endpoint, model=model, prompt=ids, stream=stream, status=status,
            block_size=block_size, params=params, output_tokens=sum(len(c.token_ids) for c in choices),
            finish_reason=choices[0].finish_reason if choices else None, finished_at=now,
            ttft_s=None if first is None else max(0.0, first - arrival),
            cached_tokens=out.num_cached_tokens if out is not None else None, error=error,
            tokenize=None if tokenizer is None else tokenizer.encode,
            decode=None if tokenizer is None else tokenizer.decode, text=text))
