"""What the engine front end and the server drive, as protocols: EngineCore (the synchronous
engine, wherever it runs; make_engine_core picks its kind), ServingEngine (what the HTTP server
drives for one model) and StatLogger."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Protocol, Union, runtime_checkable

from tessera.config import EngineConfig
from tessera.engine.frontend.core_client import ProcessEngineCore
from tessera.engine.input_processor import PreparedRequest
from tessera.vision import ImageInput
from tessera.engine.outputs import RequestOutput
from tessera.engine.stats import IterationStats, LoadSnapshot, SchedulerStats
from tessera.models.adapters import AdapterSpec
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tessera.config import ModelConfig
    from tessera.engine.frontend.ray_core import RayPlacement
    from tessera.tokenizer import Tokenizer


class EngineCore(Protocol):
    """What the async front end needs of the synchronous engine: LLMEngine in this process,
    ProcessEngineCore (its engine in a child process), RayEngineCore (in a Ray actor), or a fake
    in tests. The front end asks the core, never its kind, whether it lives and how to restart it."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer

    @property
    def alive(self) -> bool:
        """False once the core has died on its own (a process core's process exited)."""
        ...

    def restart(self) -> None:
        """Start a fresh core after it died (blocking); a core that cannot die raises RuntimeError."""
        ...

    def in_flight(self) -> list[str]:
        """The ids of the requests the core holds (what a death loses)."""
        ...

    def describe(self) -> dict:
        """Where the core runs (process id, restarts, Ray actor), for /v1/engine/stats."""
        ...

    def prepare_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                        arrival_time: Optional[float] = None, add_special_tokens: bool = True,
                        pooling: Optional[PoolingParams] = None,
                        images: Optional[list[ImageInput]] = None) -> PreparedRequest: ...

    def add_prepared(self, prepared: PreparedRequest) -> None: ...

    def add_lora(self, spec: AdapterSpec) -> None:
        """Serve the adapter `spec` (checked by models.lora.read_adapter) under `spec.name`; its
        weights load off the step loop, requests for it wait until they have."""
        ...

    def remove_lora(self, name: str) -> None:
        """Stop serving an adapter: requests running with it finish, none may name it after."""
        ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_waiting_requests(self) -> int: ...

    def get_scheduler_stats(self) -> SchedulerStats: ...

    def step_with_stats(self) -> tuple[list[RequestOutput], Optional[IterationStats]]:
        """One step's outputs and stats; ([], None) when a remote core had nothing yet."""
        ...

    def load_snapshot(self) -> LoadSnapshot: ...

    def predict_wait(self, snapshot: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]: ...

    def predict_prompt(self, prompt_tokens: int) -> Optional[float]:
        """Seconds to compute a prompt of `prompt_tokens` on an idle engine (None: no cost model)."""
        ...

    def cost_model_stats(self) -> dict: ...

    def kv_cache_info(self) -> dict: ...

    def warm_up(self) -> None: ...

    def close(self) -> None: ...


# Builds a core for a config; `wakeup` is the front end's event a waiting core returns early on.
CoreFactory = Callable[[EngineConfig, threading.Event], EngineCore]


def make_engine_core(config: EngineConfig, wakeup: Optional[threading.Event] = None, *,
                     engine_process: bool = False, ray: Optional[RayPlacement] = None, name: str = "",
                     log_level: str = "info") -> EngineCore:
    """The one place that picks a core's kind: a Ray actor (`ray`, named `name` in Ray), a child
    process (`engine_process`), or this process. Everything past here asks the EngineCore
    protocol, so a new kind of core changes nothing else."""
    if ray is not None:
        from tessera.engine.frontend.ray_core import RayEngineCore  # Ray is optional: only imported for --ray

        return RayEngineCore(config, ray, name=name or config.model, log_level=log_level, wakeup=wakeup)
    if engine_process:
        return ProcessEngineCore(config, log_level=log_level, wakeup=wakeup)
    # Imported here: a front end whose engine runs elsewhere never loads the model code (nor torch).
    from tessera.engine.llm_engine import LLMEngine

    return LLMEngine(config)


@runtime_checkable
class ServingEngine(Protocol):
    """What the HTTP server drives for one model: an AsyncLLMEngine, or a ReplicaSet of them
    (tessera/deploy/replicas.py)."""

    config: EngineConfig
    tokenizer: object
    model_config: object
    max_num_queued_requests: Optional[int]

    def generate(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
                 add_special_tokens: bool = True, deadline_s: Optional[float] = None,
                 restartable: bool = False, pooling: Optional[PoolingParams] = None,
                 lora_name: Optional[str] = None,
                 extend_deadline: Optional[Callable[[float], None]] = None,
                 images: Optional[list[ImageInput]] = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; with `pooling` an embedding request, whose one
        (final) output carries the vector; with `lora_name` through that adapter (see add_lora).
        `extend_deadline(seconds)` is called before anything runs with the forecast time of the
        prompt's own computation, which the caller adds to `deadline_s` (a long prompt is given
        the time it needs rather than cut at the deadline; only waiting for others is refused).
        `images`: processed, in the order of the prompt's image tokens."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def add_lora(self, spec: AdapterSpec) -> None:
        """Serve a LoRA adapter checked by models.adapters.read_adapter (on every replica)."""
        ...

    def remove_lora(self, name: str) -> None: ...

    def lora_adapters(self) -> list[AdapterSpec]:
        """The adapters served: --lora-modules and those added since."""
        ...

    def check_health(self) -> None: ...

    def num_active(self) -> int: ...

    def restarting(self) -> bool: ...

    def num_queued(self, priority: Optional[int] = None) -> int: ...

    def predicted_wait(self, prompt_tokens: int = 0) -> Optional[float]: ...

    def get_scheduler_stats(self) -> SchedulerStats: ...

    def cost_model_stats(self) -> dict: ...

    def kv_cache_info(self) -> dict: ...

    def core_info(self) -> dict: ...

    def warm_up(self) -> None: ...

    def shutdown(self) -> None: ...


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
