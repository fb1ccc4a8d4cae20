"""Several replicas of one model behind the surface the server drives: `tessera serve --replicas N`.

Each replica is an AsyncLLMEngine over its own engine core (a Ray actor with
`--ray`, a local engine-core process otherwise), with its own queue, stats and
restart-on-crash. A ReplicaSet tokenizes a request once, asks its routing
policy (tessera/deploy/routing.py) which replica in rotation takes it, and
streams that replica's outputs. It keeps requests whole:
- a replica that refuses at admission (queue full, forecast wait) hands the
  request to the least-loaded other replica before the client sees a 429;
- a replica that dies or stops answering leaves rotation (its engine reports
  unhealthy while its core restarts); a request it was running is rerun once
  elsewhere if nothing of it had been streamed to the client (no token yet, or
  a non-streaming request), and fails otherwise;
- scaling down drains: the replica leaves rotation at once and is closed when
  its last request has finished.
The server sees one engine (the same methods as AsyncLLMEngine), so routing,
fallback rules and metrics above it do not change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Literal, Optional, Union

from tessera.deploy.routing import ReplicaLoad, RouterPolicyName, make_policy
from tessera.engine.errors import EngineDeadError, QueueFullError
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.input_processor import PreparedRequest
from tessera.engine.outputs import KVTransfer, RequestOutput
from tessera.engine.stats import SchedulerStats
from tessera.models.adapters import AdapterSpec
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams
from tessera.vision import ImageInput

logger = logging.getLogger("tessera")

ReplicaState = Literal["starting", "ready", "draining", "stopped", "failed"]
ReplicaRole = Literal["mixed", "prefill", "decode"]
DRAIN_TIMEOUT_S = 600.0  # a draining replica is closed after this even if requests remain (they fail)


@dataclass
class Replica:
    replica_id: int
    role: ReplicaRole = "mixed"
    state: ReplicaState = "starting"
    engine: Optional[AsyncLLMEngine] = None
    error: Optional[str] = None
    active: int = 0  # requests routed here and not finished
    routed: int = 0  # requests routed here in all
    retried_away: int = 0  # requests moved to another replica after this one failed or refused them

    def healthy(self) -> bool:
        if self.state != "ready" or self.engine is None:
            return False
        try:
            self.engine.check_health()
        except EngineDeadError:
            return False
        return True

    def describe(self) -> dict:
        core = self.engine.core_info() if self.engine is not None else {}
        return {"replica": self.replica_id, "role": self.role, "state": self.state, "healthy": self.healthy(), "error": self.error,
                "active": self.active, "routed": self.routed, "retried_away": self.retried_away, **core}


class NoReplicaError(EngineDeadError):
    """No replica of the model is in rotation (all dead, restarting or draining): HTTP 503."""


ReplicaBuilder = Callable[[int], AsyncLLMEngine]
ReplicaCloser = Callable[[int, AsyncLLMEngine], None]


class ReplicaSet:
    """N replicas of one model, driven by the server as one engine (protocols.ServingEngine)."""

    def __init__(self, build: ReplicaBuilder, replicas: int, policy: RouterPolicyName = "least-loaded", *,
                 close: Optional[ReplicaCloser] = None, on_rejection: Optional[Callable[[int], None]] = None,
                 pd: Optional[tuple[int, int]] = None) -> None:
        """`build(replica_id)` makes a replica's engine (on a thread; several at once);
        `close(replica_id, engine)` releases what the builder made beside it (its stats thread);
        `on_rejection(replica_id)` counts a 429 the client gets, by the replica that refused last;
        `pd=(prefill, decode)`: disaggregate, `replicas` is ignored (see `_prefill`)."""
        if pd is not None:
            if pd[0] < 1 or pd[1] < 1:
                raise ValueError("prefill/decode disaggregation needs at least one replica of each")
            replicas = pd[0] + pd[1]
        if replicas < 1:
            raise ValueError("a replica set needs at least one replica")
        self.pd = pd
        self.kv_transfers = 0  # prompts whose KV went from a prefill replica to a decode replica
        self.kv_transfer_bytes = 0
        self.prefill_seconds = 0.0  # wall time of the prefill stage, transfers included
        self._build = build
        self._loras: dict[str, AdapterSpec] = {}  # adapters added at run time, given to every replica
        self._close = close
        self._on_rejection = on_rejection
        self.policy_name = policy
        self._lock = threading.Lock()
        self._replicas: list[Replica] = []
        self._next_id = 0
        self._where: dict[str, Replica] = {}  # request id -> replica running it
        self._threads: list[threading.Thread] = []
        self.retries = 0
        start = [self._new_replica() for _ in range(replicas)]
        if pd is not None:
            for i, replica in enumerate(start):
                replica.role = "prefill" if i < pd[0] else "decode"
        with ThreadPoolExecutor(max_workers=replicas) as pool:  # Ray places and loads them in parallel
            list(pool.map(self._start_replica, start))
        failed = [r for r in start if r.state == "failed"]
        if failed:
            self.shutdown()
            raise RuntimeError(f"{len(failed)} of {replicas} replicas failed to start: {failed[0].error}")
        first = start[0].engine
        assert first is not None
        self.config = first.config
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.policy = make_policy(policy, block_size=self.config.block_size)

    # -- replicas ------------------------------------------------------------------------------
    def _new_replica(self) -> Replica:
        with self._lock:
            replica = Replica(self._next_id)
            self._next_id += 1
            self._replicas.append(replica)
        return replica

    def _start_replica(self, replica: Replica) -> None:
        try:
            engine = self._build(replica.replica_id)
        except Exception as exc:  # noqa: BLE001 - the replica is marked failed; the set decides
            logger.exception("replica %d failed to start", replica.replica_id)
            replica.state, replica.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        for spec in list(self._loras.values()):
            engine.add_lora(spec)
        replica.engine = engine
        with self._lock:
            if replica.state == "starting":  # not drained while it loaded: into rotation
                replica.state = "ready"
        logger.info("replica %d %s (%s)", replica.replica_id, replica.state, engine.core_info())

    @property
    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas)

    def in_rotation(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy()]

    def scale(self, replicas: int) -> dict:
        """Start or drain replicas until `replicas` are ready or starting; returns at once (the
        new ones load on threads of their own, the drained ones close after their last request)."""
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.pd is not None:
            raise ValueError("a prefill/decode-disaggregated model cannot be rescaled at run time yet")
        live = [r for r in self.replicas if r.state in ("starting", "ready")]
        added, drained = [], []
        if replicas > len(live):
            for _ in range(replicas - len(live)):
                replica = self._new_replica()
                t = threading.Thread(target=self._start_replica, args=(replica,), daemon=True,
                                     name=f"tessera-replica-{replica.replica_id}-start")
                t.start()
                self._threads.append(t)
                added.append(replica.replica_id)
        else:
            # drain the least busy ones (ties: the newest), so few requests wait on a drain
            for replica in sorted(live, key=lambda r: (r.state == "ready", r.active, -r.replica_id))[:len(live) - replicas]:
                replica.state = "draining"
                self.policy.forget(replica.replica_id)
                t = threading.Thread(target=self._drain, args=(replica,), daemon=True,
                                     name=f"tessera-replica-{replica.replica_id}-drain")
                t.start()
                self._threads.append(t)
                drained.append(replica.replica_id)
        logger.info("scaling to %d replicas: starting %s, draining %s", replicas, added or "none", drained or "none")
        return {"replicas": replicas, "starting": added, "draining": drained}

    def _drain(self, replica: Replica) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while replica.engine is None and replica.state == "draining" and time.monotonic() < deadline:
            time.sleep(0.1)  # drained while still starting: wait for it, then close it
        while replica.engine is not None and replica.engine.num_active() > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop(replica)

    def _stop(self, replica: Replica) -> None:
        engine, replica.engine = replica.engine, None
        replica.state = "stopped"
        if engine is not None:
            engine.shutdown()
            if self._close is not None:
                self._close(replica.replica_id, engine)
        with self._lock:
            if replica in self._replicas:
                self._replicas.remove(replica)
        logger.info("replica %d stopped", replica.replica_id)

    # -- routing -------------------------------------------------------------------------------
    def _choose(self, token_ids: list[int], exclude: set[int], role: ReplicaRole = "mixed") -> Replica:
        candidates = [r for r in self.in_rotation() if r.replica_id not in exclude and r.role == role]
        if not candidates:
            states = ", ".join(f"{r.replica_id}: {r.state}" for r in self.replicas) or "none"
            raise NoReplicaError(f"no replica of this model can take requests now ({states})")
        chosen = self.policy.choose(token_ids, [ReplicaLoad(r.replica_id, r.active) for r in candidates])
        return next(r for r in candidates if r.replica_id == chosen)

    def _least_loaded_other(self, exclude: set[int], role: ReplicaRole = "mixed") -> Optional[Replica]:
        candidates = [r for r in self.in_rotation() if r.replica_id not in exclude and r.role == role]
        return min(candidates, key=lambda r: r.active, default=None)

    async def generate(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
                       add_special_tokens: bool = True, deadline_s: Optional[float] = None,
                       restartable: bool = False, pooling: Optional[PoolingParams] = None,
                       lora_name: Optional[str] = None,
                       extend_deadline: Optional[Callable[[float], None]] = None,
                       images: Optional[list[ImageInput]] = None) -> AsyncIterator[RequestOutput]:
        """AsyncLLMEngine.generate on the replica the policy picks (see the module's docstring).
        `restartable` (the caller reads only the final output, e.g. a non-streaming HTTP request):
        a request whose replica dies mid-way is rerun from its prompt on another replica."""
        first = self._any_engine()
        prepared = await first.prepare(prompt, params, request_id, add_special_tokens, pooling, images)
        if lora_name is not None:
            prepared = dataclasses.replace(prepared, lora_name=lora_name)
        role: ReplicaRole = "mixed"
        if self.pd is not None and pooling is not None:
            role = "prefill"  # an embedding is prefill alone: nothing to hand over to a decode replica
        elif self.pd is not None:
            role = "decode"
            if len(prepared.prompt_token_ids) > self.config.block_size:  # at least one block to hand over
                transfer = await self._prefill(prepared)
                if transfer is not None:
                    prepared = dataclasses.replace(prepared, kv_import=transfer)
        tried: set[int] = set()
        replica = self._choose(prepared.prompt_token_ids, tried, role)
        moved = False
        while True:
            tried.add(replica.replica_id)
            replica.active += 1
            replica.routed += 1
            self._where[request_id] = replica
            streamed = False
            engine = replica.engine
            try:
                if engine is None:
                    raise NoReplicaError(f"replica {replica.replica_id} stopped")
                async with contextlib.aclosing(engine.generate(prompt, params, request_id, add_special_tokens,
                                                               deadline_s, prepared=prepared,
                                                               extend_deadline=extend_deadline)) as stream:
                    async for out in stream:
                        streamed = True
                        yield out
                return
            except (EngineDeadError, QueueFullError) as exc:
                retry = not moved and (not streamed or (restartable and isinstance(exc, EngineDeadError)))
                other = self._least_loaded_other(tried, role) if retry else None
                if other is None:
                    if isinstance(exc, QueueFullError) and self._on_rejection is not None:
                        self._on_rejection(replica.replica_id)
                    raise
                kind = "refused" if isinstance(exc, QueueFullError) else "failed"
                logger.warning("replica %d %s request %s %s (%s); running it on replica %d",
                               replica.replica_id, kind, request_id,
                               "mid-way (not streamed)" if streamed else "before its first token", exc,
                               other.replica_id)
                replica.retried_away += 1
                self.retries += 1
                moved = True
                replica = other
            finally:
                replica_now = self._where.pop(request_id, None)
                if replica_now is not None:
                    replica_now.active -= 1

    async def _prefill(self, prepared: PreparedRequest) -> Optional[KVTransfer]:
        """Prefill/decode disaggregation: a prefill replica computes the prompt (one token, which
        is dropped) and returns its full blocks' KV with the final output; the decode replica
        then loads them as prefix-cache hits and computes only the last partial block, so its
        running streams see a short chunk instead of the whole prompt. The blocks travel as bytes
        through this process (ZeroMQ over TCP both ways). None when no prefill replica can take
        it or it fails: the decode replica then computes the prompt itself."""
        replica = self._least_loaded_other(set(), "prefill")
        if replica is None or replica.engine is None:
            return None
        pp = dataclasses.replace(prepared, request_id=prepared.request_id + ":prefill",
                                 params=SamplingParams(max_tokens=1, temperature=0), max_tokens=1, grammar=None,
                                 kv_export=True)
        t0 = time.monotonic()
        replica.active += 1
        replica.routed += 1
        final: Optional[RequestOutput] = None
        try:
            async with contextlib.aclosing(replica.engine.generate(pp.prompt_token_ids, pp.params, pp.request_id,
                                                                   prepared=pp)) as stream:
                async for out in stream:
                    final = out
        except (EngineDeadError, QueueFullError) as exc:
            logger.warning("prefill replica %d could not take %s (%s); the decode replica computes the prompt",
                           replica.replica_id, prepared.request_id, exc)
            return None
        finally:
            replica.active -= 1
        if final is None or final.kv_transfer is None or not final.kv_transfer.block_hashes:
            return None
        self.kv_transfers += 1
        self.kv_transfer_bytes += len(final.kv_transfer.payload)
        self.prefill_seconds += time.monotonic() - t0
        return final.kv_transfer

    def _any_engine(self) -> AsyncLLMEngine:
        for r in self.replicas:
            if r.engine is not None and r.state in ("ready", "draining"):
                return r.engine
        raise NoReplicaError("no replica of this model is running")

    async def abort(self, request_id: str) -> None:
        replica = self._where.get(request_id)
        if replica is not None and replica.engine is not None:
            await replica.engine.abort(request_id)

    def add_lora(self, spec: AdapterSpec) -> None:
        """Serve an adapter on every replica, and on those started later."""
        self._loras[spec.name] = spec
        for r in self.replicas:
            if r.engine is not None:
                r.engine.add_lora(spec)

    def remove_lora(self, name: str) -> None:
        self._loras.pop(name, None)
        for r in self.replicas:
            if r.engine is not None:
                r.engine.remove_lora(name)

    def lora_adapters(self) -> list[AdapterSpec]:
        engine = next((r.engine for r in self.replicas if r.engine is not None), None)
        return list({**({s.name: s for s in engine.lora_adapters()} if engine else {}), **self._loras}.values())

    # -- the AsyncLLMEngine surface the server reads -----------------------------------------
    def check_health(self) -> None:
        if not self.in_rotation():
            states = ", ".join(f"{r.replica_id}: {r.state}" for r in self.replicas) or "none"
            raise NoReplicaError(f"no replica of this model is healthy ({states})")

    @property
    def max_num_queued_requests(self) -> Optional[int]:
        limits = [r.engine.max_num_queued_requests for r in self.in_rotation() if r.engine is not None]
        return None if not limits or any(v is None for v in limits) else sum(limits)  # type: ignore[misc]

    def num_active(self) -> int:
        return sum(r.engine.num_active() for r in self.replicas if r.engine is not None)

    def restarting(self) -> bool:
        return any(r.engine.restarting() for r in self.replicas if r.engine is not None)

    def num_queued(self, priority: Optional[int] = None) -> int:
        return sum(r.engine.num_queued(priority) for r in self.replicas if r.engine is not None)

    def predicted_wait(self, prompt_tokens: int = 0) -> Optional[float]:
        """The shortest forecast among replicas in rotation (where the least-loaded policy sends it)."""
        waits = [w for r in self.in_rotation() if r.engine is not None
                 and (w := r.engine.predicted_wait(prompt_tokens)) is not None]
        return min(waits, default=None)

    def get_scheduler_stats(self) -> SchedulerStats:
        """The sum over running replicas (KV usage: the share of all their blocks in use)."""
        total = SchedulerStats()
        classes: dict[int, list[int]] = {}  # priority -> [running, waiting], summed
        for r in self.replicas:
            if r.engine is None:
                continue
            s = r.engine.get_scheduler_stats()
            for f in dataclasses.fields(SchedulerStats):
                if f.name in ("lora_running", "lora_waiting"):  # requests per adapter, summed by name
                    counts = getattr(total, f.name)
                    for name, n in getattr(s, f.name).items():
                        counts[name] = counts.get(name, 0) + n
                elif f.name not in ("kv_cache_usage", "requests_by_priority"):
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
            for p, running, waiting in s.requests_by_priority:
                c = classes.setdefault(p, [0, 0])
                c[0] += running
                c[1] += waiting
        total.requests_by_priority = tuple((p, c[0], c[1]) for p, c in sorted(classes.items()))
        if total.num_blocks_total:
            total.kv_cache_usage = 1.0 - total.num_blocks_free / total.num_blocks_total
        return total

    def cost_model_stats(self) -> dict:
        return self._any_engine().cost_model_stats()

    def kv_cache_info(self) -> dict:
        return self._any_engine().kv_cache_info()

    def core_info(self) -> dict:
        out = {"engine_process": True, "replicas": [r.describe() for r in self.replicas],
               "router_policy": self.policy_name, "retries": self.retries}
        if self.pd is not None:
            out["pd"] = {"prefill": self.pd[0], "decode": self.pd[1], "kv_transfers": self.kv_transfers,
                         "kv_transfer_bytes": self.kv_transfer_bytes,
                         "prefill_seconds": round(self.prefill_seconds, 3)}
        return out

    def warm_up(self) -> None:
        pass  # each replica warmed up when it was built

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.state = "draining"
        for replica in self.replicas:
            self._stop(replica)
