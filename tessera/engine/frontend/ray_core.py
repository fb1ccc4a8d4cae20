"""An engine core placed by Ray: the same core loop as the engine-core process, in a Ray actor.

Ray decides where a replica runs (its CPUs, memory and GPUs come from the
actor's resource request), restarts its process when it dies, and ends it
with the server that created it. The data path stays the one the local
engine-core process uses (ZeroMQ + msgspec deltas, tessera/engine/frontend/wire.py),
over TCP instead of a Unix socket: this process binds two ports on its node's
address and the actor connects to them. That is vLLM's data-parallel shape on
Ray as well (Ray places the engine cores, ZeroMQ carries requests and
outputs); Ray's object store would add a copy and a scheduling hop per step.

Imported only when `tessera serve --ray` is used: `ray` is an optional
dependency (`pip install tessera[ray]`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from tessera.config import EngineConfig
from tessera.engine.frontend.core_client import ProcessEngineCore
from tessera.engine.frontend.core_process import run_engine_core

logger = logging.getLogger("tessera")

ACTOR_START_TIMEOUT_S = 600.0  # Ray placing and (re)starting the actor's process, before the model loads
LIVENESS_CHECK_S = 0.5  # how often a wait for the core's next result asks Ray whether the actor lives


@dataclass(frozen=True)
class RayPlacement:
    """What one replica asks of Ray. `num_cpus` also becomes the actor's OMP_NUM_THREADS, so it
    is the replica's torch thread count; `node_id` pins it to one node (tests, P/D layouts)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_bytes: Optional[int] = None
    node_id: Optional[str] = None

    def __post_init__(self) -> None:
        if self.num_cpus <= 0 or self.num_gpus < 0:
            raise ValueError("a replica needs num_cpus > 0 and num_gpus >= 0")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError("memory_bytes must be positive")

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                # Ray starts a new process after a crash (the client calls run() again)
                                "max_restarts": -1, "max_task_retries": 0}
        if self.memory_bytes is not None:
            opts["memory"] = self.memory_bytes
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        return opts


class _EngineCoreActor:
    """The actor's body; `ray.remote` wraps it in `_actor_class()`."""

    def ping(self) -> tuple[int, str]:
        import os

        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, config_pickle: bytes, in_addr: str, out_addr: str, log_level: str) -> None:
        """The core loop; returns on Shutdown. Runs for the actor's life (one task at a time)."""
        run_engine_core(config_pickle, in_addr, out_addr, None, log_level)


def _actor_class():
    import ray

    return ray.remote(_EngineCoreActor)


class RayEngineCore(ProcessEngineCore):
    """A ProcessEngineCore whose core is a Ray actor, possibly on another node."""

    def __init__(self, config: EngineConfig, placement: RayPlacement, *, name: str, log_level: str = "info",
                 wakeup: Optional[threading.Event] = None) -> None:
        import ray

        self.placement = placement
        self.actor_name = name
        self._host = ray.util.get_node_ip_address()
        self._actor = _actor_class().options(**placement.actor_options()).remote()
        self._run_ref = None
        self._last_check = 0.0
        self._alive = True
        self.node_id: Optional[str] = None
        super().__init__(config, log_level=log_level, wakeup=wakeup)

    def _bind(self, sock: zmq.Socket, direction: str) -> str:
        port = sock.bind_to_random_port("tcp://*")
        return f"tcp://{self._host}:{port}"

    def _launch(self, config_pickle: bytes, in_addr: str, out_addr: str) -> None:
        import ray

        # Waits for Ray to (re)start the actor's process before the core is asked to run.
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        while True:
            try:
                _, self.node_id = ray.get(self._actor.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorUnavailableError:  # restarting after a crash: ask again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._run_ref = self._actor.run.remote(config_pickle, in_addr, out_addr, self.log_level)
        self._alive, self._last_check = True, 0.0

    @property
    def alive(self) -> bool:
        """Whether the actor's core loop still runs (asked of Ray at most every LIVENESS_CHECK_S)."""
        import ray

        if self._run_ref is None or not self._alive:
            return False
        now = time.monotonic()
        if now - self._last_check >= LIVENESS_CHECK_S:
            self._last_check = now
            done, _ = ray.wait([self._run_ref], timeout=0)
            self._alive = not done
        return self._alive

    def _exit_code(self) -> Optional[int]:
        import ray

        if self._run_ref is None:
            return None
        try:
            ray.get(self._run_ref, timeout=0)
        except Exception as exc:  # noqa: BLE001 - the reason, for the log line
            logger.warning("replica %s: %s", self.actor_name, str(exc).splitlines()[0])
            return None
        return 0

    def _stop_core(self, kill: bool) -> None:
        """After a crash (`kill`) the actor is left to Ray, which restarts its process; on close
        it ends for good once its loop has returned."""
        import ray

        if self._run_ref is None:
            return
        if kill:
            done, _ = ray.wait([self._run_ref], timeout=0)
            if not done:  # a hung core: end its process; Ray starts a new one
                try:
                    ray.kill(self._actor, no_restart=False)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            self._run_ref = None
            return
        try:
            ray.wait([self._run_ref], timeout=30)
        finally:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._run_ref = None

    def describe(self) -> dict:
        out = super().describe()
        out.update({"ray_actor": self.actor_name, "node_id": self.node_id})
        return out
