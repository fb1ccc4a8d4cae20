"""Per-key limits: requests and tokens per minute, concurrent requests, and a fair share of each
model's waiting queue between keys.

Rates are token buckets that refill continuously at `limit / 60` per second and hold one
second's worth (at least one unit), the way hosted APIs quantise their per-minute limits (a
60 RPM key gets one request a second, not sixty at once then nothing): a key is held to its
rate over any window, with at most one second's burst above it.

Tokens are charged as they are generated (prompt tokens when the prompt is admitted, each
generated token when it comes out), so a long stream spends its key's budget while it runs and
the key's next request waits until the bucket is out of debt. So that many requests admitted at
once cannot all spend the same budget, each admitted request reserves the key's recent mean
tokens per request up front (at most the bucket's burst); what it generates is charged against that reservation first, and
the unused part is returned when it ends.

Everything here runs on the server's event loop (the auth middleware and the request's
generation tasks), so nothing needs a lock.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from tessera.engine.outputs import RequestOutput

# A bucket holds this many seconds of its rate (and at least one unit).
BURST_SECONDS = 1.0
# A key that sent a request to a model within this many seconds still counts for that model's
# fair share (so one key cannot retake the whole queue between another key's requests).
ACTIVE_WINDOW_S = 30.0
# What a new key's requests are assumed to cost in tokens until it has a history.
INITIAL_TOKENS_PER_REQUEST = 64.0
_MEAN_WEIGHT = 0.2  # of the newest request in the running mean of tokens per request


class TokenBucket:
    """A per-minute limit as a continuously refilled bucket whose level may go below zero (a
    debt, when tokens are charged after admission)."""

    __slots__ = ("per_minute", "rate", "capacity", "level", "stamp")

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate * BURST_SECONDS)
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0: now)."""
        self.refill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def charge(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def remaining(self, now: float) -> int:
        self.refill(now)
        return max(0, math.floor(self.level))

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        self.refill(now)
        return max(0.0, (self.capacity - self.level) / self.rate)


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass
class Refusal:
    """Why a key's request is refused (429): which limit, the message, and when to retry."""

    limit: str  # rpm, tpm, concurrency, queue_share
    message: str
    retry_after_s: float


@dataclass
class _QueueShare:
    queued: int = 0  # this key's requests at the engine that have not produced their first output
    last_seen: float = 0.0


class KeyLimiter:
    """The live limit state of one API key: its buckets, its running requests, and its requests
    queued at each model's engine."""

    def __init__(self, name: str, rpm: Optional[int], tpm: Optional[int], max_concurrent: Optional[int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        now = clock()
        self.name = name
        self.clock = clock
        self.requests = TokenBucket(rpm, now) if rpm else None
        self.tokens = TokenBucket(tpm, now) if tpm else None
        self.max_concurrent = max_concurrent
        self.running = 0
        self.tokens_per_request = INITIAL_TOKENS_PER_REQUEST

    @property
    def limited(self) -> bool:
        return self.requests is not None or self.tokens is not None or self.max_concurrent is not None

    def admit(self) -> Optional[Refusal]:
        """Take a request slot now, or say which limit refuses it."""
        now = self.clock()
        if self.max_concurrent is not None and self.running >= self.max_concurrent:
            return Refusal("concurrency", f"This API key already has {self.running} requests running, its limit "
                                          f"of concurrent requests.", 1.0)
        if self.requests is not None:
            wait = self.requests.wait_for(1.0, now)
            if wait > 0:
                return Refusal("rpm", f"Rate limit reached for requests per minute (RPM): limit "
                                      f"{self.requests.per_minute}. Try again in {format_reset(wait)}.", wait)
        if self.tokens is not None:
            wait = self.tokens.wait_for(1e-9, now)  # admitted while the bucket is not in debt
            if wait > 0:
                return Refusal("tpm", f"Rate limit reached for tokens per minute (TPM): limit "
                                      f"{self.tokens.per_minute}. Try again in {format_reset(wait)}.", wait)
        if self.requests is not None:
            self.requests.charge(1.0, now)
        self.running += 1
        return None

    def release(self) -> None:
        self.running -= 1

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for this key's limits (none for an unlimited one)."""
        now = self.clock()
        out = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out += [(f"x-ratelimit-limit-{kind}".encode(), str(bucket.per_minute).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(bucket.remaining(now)).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), format_reset(bucket.reset_s(now)).encode())]
        return out

    def note_request_tokens(self, tokens: int) -> None:
        self.tokens_per_request += _MEAN_WEIGHT * (tokens - self.tokens_per_request)


class FairShare:
    """Each model's waiting queue shared between the keys using it: while the queue is at least
    half full, a key may hold at most `bound // active keys` of it, and never the last quarter
    while other keys exist in the key set (room for another key's first requests before it counts
    as active), so one key's burst cannot take every place and turn everyone else's requests into
    429s. Keys count as active for a model for ACTIVE_WINDOW_S after their last request to it.

    How full the queue is is the larger of the engine's count and the places the keys hold here:
    a request takes its place here when it is routed, but the engine counts it only once it
    reaches `generate` a few awaits later, so a burst arriving at once would otherwise find the
    queue empty on every request and pass the cap all together."""

    def __init__(self, num_keys: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_keys = num_keys
        self.clock = clock
        self._by_engine: dict[int, dict[str, _QueueShare]] = {}

    def enter(self, key: str, engine: object, bound: Optional[int], num_queued: int) -> Optional[Refusal]:
        """Count one more request of `key` waiting at `engine` (a queue of `bound` places, of which
        `num_queued` are taken), or refuse it."""
        now = self.clock()
        shares = self._by_engine.setdefault(id(engine), {})
        mine = shares.setdefault(key, _QueueShare())
        mine.last_seen = now
        if bound is not None and bound > 0 and self.num_keys > 1:
            active = sum(1 for k, s in shares.items() if k == key or s.queued > 0
                         or now - s.last_seen < ACTIVE_WINDOW_S)
            share = min(max(1, bound // active), max(1, bound - max(1, bound // 4)))
            held = sum(s.queued for s in shares.values())
            if mine.queued >= share and max(num_queued, held) >= bound // 2:
                return Refusal("queue_share", f"This API key already holds {mine.queued} of the model's "
                                              f"{bound} queue places, its fair share while other keys wait; "
                                              "retry shortly.", 1.0)
        mine.queued += 1
        return None

    def leave(self, key: str, engine: object) -> None:
        share = self._by_engine.get(id(engine), {}).get(key)
        if share is not None and share.queued > 0:
            share.queued -= 1

    def queued(self, key: str, engine: object) -> int:
        share = self._by_engine.get(id(engine), {}).get(key)
        return 0 if share is None else share.queued


@dataclass
class KeyMeter:
    """One HTTP request's account with its key: the tokens it is charged as they are generated,
    its place in a model's queue until its first output, and what it reserved at admission.

    Left in the request's ASGI state by the auth middleware; `Generation` calls `observe` with
    each output, `ServerState.route` calls `queue_at` once the model is known."""

    limiter: KeyLimiter
    fair: FairShare
    on_tokens: Optional[Callable[[str, int, int], None]] = None  # (key name, prompt, generated)
    on_refusal: Optional[Callable[[str, str], None]] = None  # (key name, what refused: model, queue_share)
    reserved: float = 0.0
    charged: int = 0
    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # engine request id -> (prompt, generated)
    _queued_at: Optional[object] = None

    def __post_init__(self) -> None:
        tokens = self.limiter.tokens
        if tokens is not None:
            self.reserved = max(1.0, min(self.limiter.tokens_per_request, tokens.capacity))
            tokens.charge(self.reserved, self.limiter.clock())

    @property
    def key_name(self) -> str:
        return self.limiter.name

    def queue_at(self, engine: object, bound: Optional[int], num_queued: int) -> Optional[Refusal]:
        self.started()
        refusal = self.fair.enter(self.limiter.name, engine, bound, num_queued)
        if refusal is None:
            self._queued_at = engine
        return refusal

    def refused(self, what: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal(self.limiter.name, what)

    def started(self) -> None:
        """The request's first output came: it no longer waits in the model's queue."""
        if self._queued_at is not None:
            self.fair.leave(self.limiter.name, self._queued_at)
            self._queued_at = None

    def observe(self, request_id: str, output: RequestOutput) -> None:
        """Charge the tokens new in `output` (cumulative) since the last one of the same request."""
        self.started()
        prompt = len(output.prompt_token_ids)
        generated = sum(len(c.token_ids) for c in output.outputs)
        seen_prompt, seen_generated = self._seen.get(request_id, (0, 0))
        self._seen[request_id] = (prompt, generated)
        self._charge(max(0, prompt - seen_prompt), max(0, generated - seen_generated))

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        """At the end: charge what the request's reported usage has beyond what was observed (an
        endpoint that does not stream through `Generation`), return the unused reservation."""
        self.started()
        seen_prompt = sum(p for p, _ in self._seen.values())
        seen_generated = sum(g for _, g in self._seen.values())
        self._charge(max(0, prompt_tokens - seen_prompt), max(0, completion_tokens - seen_generated))
        tokens = self.limiter.tokens
        if tokens is not None and self.reserved > 0:
            tokens.charge(-self.reserved, self.limiter.clock())
            self.reserved = 0.0
        if self.charged:
            self.limiter.note_request_tokens(self.charged)

    def _charge(self, prompt: int, generated: int) -> None:
        amount = prompt + generated
        if not amount:
            return
        self.charged += amount
        tokens = self.limiter.tokens
        if tokens is not None:
            from_reserve = min(self.reserved, amount)
            self.reserved -= from_reserve
            if amount > from_reserve:
                tokens.charge(amount - from_reserve, self.limiter.clock())
        if self.on_tokens is not None:
            self.on_tokens(self.limiter.name, prompt, generated)
