"""Configuration objects passed down from the CLI to every engine part.

One `ModelConfig` describes the network (read from GGUF metadata or a
Hugging Face config.json); one `EngineConfig` holds every serving knob. Both
are plain dataclasses so they can be logged, compared and copied freely.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from tessera.activations import ActivationName, activation
from tessera.config_choices import (ATTENTION_BACKENDS, CPU_ISAS, DENSE_WEIGHT_COPIES, DEVICES, DTYPES, KV_CACHE_DTYPES,
                                    PREEMPTION_MODES, QUANTIZATIONS, SCHEDULER_POLICIES, SCHEDULING_POLICIES)
from tessera.errors import ConfigError
from tessera.hostinfo import cuda_available
from tessera.lora_config import LORA_MAX_RANKS, LoRAModule
from tessera.pooling_params import POOLING_TYPES, PoolerConfig
from tessera.profiles import DEFAULT_PROFILE, PROFILE_FIELDS, PROFILE_SETTINGS, PROFILES
from tessera.speculative_config import SpeculativeConfig
from tessera.vision import VisionConfig


@dataclass
class MoEConfig:
    """A mixture-of-experts feed-forward block: a router scores every expert for each token, the
    `top_k` best run and their outputs are summed with the routing weights. The families differ
    only in the values below (tessera/models/families: qwen3moe, mixtral, gpt-oss)."""

    num_experts: int
    top_k: int  # experts per token
    expert_ffn: int  # each expert's intermediate size
    # Routing weights: the softmax over the chosen experts' logits (Mixtral, gpt-oss, Qwen3-MoE
    # with norm_topk_prob) or the softmax over all experts, taken at the chosen ones (Qwen3-MoE
    # without it).
    renormalize: bool = True
    router_bias: bool = False  # gpt-oss
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    # The experts' activation: SwiGLU, or gpt-oss's clamped variant
    # (up.clamp(+-limit) + 1) * gate.clamp(max=limit) * sigmoid(alpha * gate).
    activation: ActivationName = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # Per layer, False = a dense MLP of the model's intermediate_size instead (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step); None: every layer is sparse.
    sparse_layers: Optional[list[bool]] = None

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"{self.top_k} experts per token out of {self.num_experts}")
        if self.expert_ffn < 1:
            raise ConfigError(f"expert intermediate size {self.expert_ffn}")
        try:
            activation(self.activation)
        except ValueError as e:
            raise ConfigError(f"expert {e}") from None

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or self.sparse_layers[layer]


@dataclass
class MambaConfig:
    """A Mamba-2 mixer's shape (Granite 4.0-H's `mamba` layers; transformers' mamba_* keys):
    `heads` heads of `head_dim` channels (`inner` in all), B and C of `d_state` per group of heads,
    a causal convolution of `conv_kernel` over x, B and C, and the time step clamped to
    [dt_min, dt_max]."""

    heads: int
    head_dim: int
    d_state: int
    inner: int
    groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        if min(self.heads, self.head_dim, self.d_state, self.groups, self.conv_kernel) < 1:
            raise ConfigError(f"Mamba-2 shape {self}")
        if self.heads * self.head_dim != self.inner or self.heads % self.groups:
            raise ConfigError(f"Mamba-2: {self.heads} heads of {self.head_dim} are not {self.inner} channels in "
                              f"{self.groups} groups")

    @property
    def conv_dim(self) -> int:
        """Channels the convolution runs over: x, then B and C of every group."""
        return self.inner + 2 * self.groups * self.d_state


@dataclass
class ModelConfig:
    """Shape of a transformer (a decoder, or a BERT encoder), independent of file format."""

    architecture: str  # a decoder family's name (tessera/models/families) or "bert"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (qwen2)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Decoder variants, as the file describes them; which of them a family uses is in its
    # description (tessera/models/families), and the shared decoder reads them from here.
    sliding_window: Optional[int] = None
    sliding_window_pattern: Optional[int] = None  # every Nth layer is global
    sliding_layers: Optional[list[bool]] = None  # per layer, True = sliding window (over the pattern)
    rope_local_base_freq: Optional[float] = None  # RoPE base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by its -1/2 power (Gemma)
    attention_multiplier: Optional[float] = None  # scores scaled by it (Granite)
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    embedding_multiplier: Optional[float] = None  # embeddings times it (Granite)
    residual_multiplier: float = 1.0  # each sublayer's output times it before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    rotary_dim: Optional[int] = None  # dimensions of each head RoPE rotates (partial rotary); None: all
    nope_layers: list[int] = field(default_factory=list)  # layers without RoPE (SmolLM3)
    attention_output_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit in each softmax's denominator (gpt-oss)
    moe: Optional[MoEConfig] = None  # mixture-of-experts feed-forward blocks; None: dense MLPs
    # Per layer, the mixer before its MLP: "attention", "conv" (LFM2's gated short convolution,
    # whose per-request state is the last conv_kernel - 1 inputs of each channel) or "mamba" (a
    # Mamba-2 mixer of `mamba`'s shape: its convolution's inputs and its SSM state); None: all attention.
    layer_kinds: Optional[list[str]] = None
    mamba: Optional[MambaConfig] = None
    conv_kernel: int = 0  # a conv layer's kernel length in tokens (LFM2's conv_L_cache)
    conv_bias: bool = False  # biases on a conv layer's projections and convolution
    # bert (encoders) only: bidirectional attention over the whole input, absolute positions
    is_causal: bool = True
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12
    hidden_act: str = ""
    # Trained so that a prefix of the embedding is an embedding (config.json's is_matryoshka or
    # matryoshka_dimensions, vLLM's keys): `dimensions` may shorten it
    matryoshka: bool = False
    # How the model embeds, when its folder says (sentence-transformers); None: it does not say
    pooler: Optional[PoolerConfig] = None
    # The image side of a vision-language model (LLaVA: a CLIP tower and a projector); None: text only
    vision: Optional[VisionConfig] = None
    name: str = ""  # display name (registry name or file stem)
    quantization: str = ""  # e.g. "Q4_1" as found in the file, informational

    def attention_scale(self) -> float:
        """The factor attention scores are scaled by: the file's own where it has one, else
        1/sqrt(head_dim)."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def state_layers(self) -> list[int]:
        """Layers that keep a fixed-size state per request instead of K/V (empty for most models)."""
        return [i for i, kind in enumerate(self.layer_kinds or ()) if kind != "attention"]

    def attention_layers(self) -> list[int]:
        """Layers that attend, so keep K/V in the block pool."""
        state = set(self.state_layers())
        return [i for i in range(self.num_layers) if i not in state]

    def state_shapes(self, layer: int) -> list[tuple[tuple[int, ...], bool]]:
        """One request's state tensors in state layer `layer`, as (shape, kept in float32 whatever
        the compute dtype): a convolution's [channels, kernel - 1] (the inputs the next token's
        convolution reads besides its own); a Mamba-2 layer's also its SSM state [heads, head_dim,
        d_state], in float32 (it accumulates over the whole sequence)."""
        m = self.mamba
        if self.layer_kinds is not None and self.layer_kinds[layer] == "mamba" and m is not None:
            return [((m.conv_dim, m.conv_kernel - 1), False), ((m.heads, m.head_dim, m.d_state), True)]
        return [((self.hidden_size, max(0, self.conv_kernel - 1)), False)]

    def state_bytes(self, itemsize: int) -> int:
        """Bytes of one request's states over every state layer, at `itemsize` bytes a value of the
        compute dtype."""
        return sum(math.prod(shape) * (4 if f32 else itemsize)
                   for i in self.state_layers() for shape, f32 in self.state_shapes(i))

    def layer_windows(self) -> list[Optional[int]]:
        """Each layer's sliding window in tokens, None for full attention: per layer where the file
        lists the layers' kinds, else with a window and a pattern layer i is global when (i + 1) is a
        multiple of the pattern (Gemma's rule); without a window all are global. The model and the
        KV cache's block groups both read this."""
        if self.sliding_layers is not None:
            if len(self.sliding_layers) != self.num_layers:
                raise ConfigError(f"{len(self.sliding_layers)} per-layer attention kinds for {self.num_layers} layers")
            window = int(self.sliding_window) if self.sliding_window else None
            return [window if sliding else None for sliding in self.sliding_layers]
        pattern = self.sliding_window_pattern or 0
        window = self.sliding_window if self.sliding_window and pattern > 0 else None
        return [None if window is None or (i + 1) % pattern == 0 else int(window)
                for i in range(self.num_layers)]


# An encoder's step size where no flag sets it: its steps are whole inputs and nothing decodes, so
# the profiles' decode-latency budgets do not apply, and larger steps amortise the per-step work
# (all-MiniLM-L6-v2, 32 texts of 64 tokens: 1.49x sentence-transformers' texts/s in steps of 1,024
# tokens, 2.1x in one step; docs/performance.md, "Embeddings").
ENCODER_MAX_NUM_BATCHED_TOKENS = 8192
ENCODER_MAX_NUM_SEQS = 256

# Memory kept free beyond what the sizing calculator predicts (leave room for length
# variance; vLLM's default GPU memory utilization of 0.9 keeps the same tenth).
DEFAULT_MEMORY_MARGIN = 0.10


@dataclass
class EngineConfig:
    """Every serving knob; the CLI maps flags 1:1 onto these fields.

    Fields left None take their value from the profile; an explicit value overrides it.
    """

    model: str = "smollm2-135m"
    # cpu or cuda; "auto" is resolved here (cuda when torch sees a GPU), so every part built from
    # this config reads one answer.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Share of the GPU's memory this engine may hold, weights and activations included (vLLM's
    # --gpu-memory-utilization); the KV cache gets what is left. CPU engines ignore it.
    gpu_memory_utilization: float = 0.9
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # The CPU instruction-set level the C kernels and PyTorch may use (kernels/isa.py): None follows
    # TESSERA_CPU_ISA (auto: the host's best); a lower level measures and tests it on this host.
    cpu_isa: Optional[str] = None
    # Weight storage of Linear layers (vLLM's --quantization): auto keeps the file's precision class.
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    # Quantized weights also kept dense for large steps (prefill, big batches): auto = when small.
    dense_weight_copy: Literal["auto", "on", "off"] = "auto"
    # Map the weights as an earlier start packed them ($TESSERA_HOME/packed), or write them there.
    weight_cache: bool = True
    # Q6_K and Q4_K tensors at the file's width times int8-quantized activations
    # (layers/quantization/kquant.py), bfloat16 only; off keeps them int8 / int4.
    int8_activations: bool = True
    # Every step through the model's modules (vLLM's flag): no one-call C decode step
    # (models/fused_decode.py); for measuring it against the modules, or ruling it out.
    enforce_eager: bool = False
    block_size: int = 16
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "int8"] = "auto"
    kv_cache_memory: Optional[int] = None  # bytes; None = derived from RAM and model size
    # Disk tier of the prefix cache (engine/core/kv_offload.py): a folder, and the most it may hold.
    kv_offload_dir: Optional[str] = None
    kv_offload_size: int = 8 << 30
    # Sliding-window layers keep only their window's blocks (attention/kv_groups.py); True keeps
    # every layer's blocks for the whole context, as for full attention (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False
    max_model_len: Optional[int] = None  # None = min(model max positions, 4096)
    profile: Literal["auto", "chat-solo", "multi-agent", "bursty"] = "auto"
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    # Step time aimed at while decodes run; prefill chunks are sized to it. 0 = no target.
    target_itl_ms: Optional[float] = None
    # The least prompt chunk worth sizing a step to the target for: where the target leaves room
    # for fewer tokens, the step's prompts take the whole budget instead (a few late steps rather
    # than prompts crawling, or every step a mixed one past the target).
    min_prefill_chunk: Optional[int] = None
    enable_prefix_caching: Optional[bool] = None
    preemption_mode: Optional[Literal["recompute", "swap"]] = None
    swap_space: int = 1 << 30  # bytes of host memory for swapped-out blocks
    scheduler_policy: Literal["continuous", "static"] = "continuous"
    # Who goes first (vLLM's flag): fcfs, or each request's `priority` (lower first) for admission,
    # the token budget and preemption.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Under the priority policy, requests of this priority or past it (the Batch API's) are background
    # work: each step gives them only the room the latency target leaves beside the others.
    background_priority: int = 1000
    # How much longer background work may make a step that carries other requests, as a share of
    # its predicted time (their inter-token latency grows by about that much).
    background_step_slack: float = 0.05
    attention_backend: Literal["auto", "paged", "sdpa", "reference", "triton"] = "auto"
    num_threads: Optional[int] = None
    seed: int = 0
    # Speculative decoding (vLLM's --speculative-config); None = off.
    speculative_config: Optional[SpeculativeConfig] = None
    # Embeddings from a decoder (or another pooling for an encoder): mean, cls or last token;
    # None = the model folder's own (sentence-transformers), else the model does not embed.
    pooling: Optional[Literal["mean", "cls", "last"]] = None
    # LoRA adapters (vLLM's flags): served from start-up (`lora_modules`) or loaded at run time
    # (/v1/load_lora_adapter, which needs enable_lora); at most `max_loras` different adapters in
    # one step, at most `max_cpu_loras` (default max_loras) kept in memory, the rest read again
    # from their files when asked for.
    enable_lora: bool = False
    lora_modules: tuple = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # The adapters' weights (vLLM's --lora-dtype): auto = bfloat16, which halves their bytes (a decode
    # step reads every adapter it serves) whatever the activations' dtype; float32 for exactness.
    lora_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Profile fields given explicitly (they beat the profile); filled in when the profile is applied.
    profile_overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.profile, str) or self.profile not in PROFILES:
            raise ConfigError(f"--profile must be one of {', '.join(PROFILES)}, not {self.profile!r}")
        if self.profile == "auto":
            self.profile = DEFAULT_PROFILE
        unset = [name for name in PROFILE_FIELDS if getattr(self, name) is None]
        if unset:
            self.profile_overrides = tuple(n for n in PROFILE_FIELDS if n not in unset)
            preset = PROFILE_SETTINGS[self.profile]
            for name in unset:
                setattr(self, name, getattr(preset, name))
        choices = [("quantization", QUANTIZATIONS), ("dense_weight_copy", DENSE_WEIGHT_COPIES),
                   ("preemption_mode", PREEMPTION_MODES), ("scheduler_policy", SCHEDULER_POLICIES),
                   ("scheduling_policy", SCHEDULING_POLICIES),
                   ("attention_backend", ATTENTION_BACKENDS), ("kv_cache_dtype", KV_CACHE_DTYPES),
                   ("device", DEVICES)]
        if self.cpu_isa is not None:
            choices.append(("cpu_isa", CPU_ISAS))
        if isinstance(self.dtype, str):  # a torch.dtype from the Python API is checked when resolved
            choices.append(("dtype", DTYPES))
        for name, allowed in choices:
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, not {value!r}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "min_prefill_chunk"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        bg = self.background_priority
        if isinstance(bg, bool) or not isinstance(bg, int) or not -(2**63) <= bg < 2**63:
            raise ConfigError(f"--background-priority must be an integer, not {bg!r}")
        slack = self.background_step_slack
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 10:
            raise ConfigError(f"--background-step-slack must be a share in [0, 10], not {slack!r}")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_offload_dir is not None:
            if not self.enable_prefix_caching:
                raise ConfigError("--kv-offload-dir is a tier of the prefix cache: it needs --enable-prefix-caching")
            if int(self.kv_offload_size) < 1:
                raise ConfigError("--kv-offload-size must be positive")
            if self.speculative_config is not None and self.speculative_config.method == "draft_model":
                raise ConfigError("--kv-offload-dir does not store a draft model's KV; use it without "
                                  "draft_model speculation (ngram and layer_skip are fine)")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ConfigError(f"--pooling must be one of {', '.join(POOLING_TYPES)}, not {self.pooling!r}")
        self._check_lora()
        util = self.gpu_memory_utilization
        if not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be a fraction in (0, 1], not {util!r}")
        if self.device == "auto":
            self.device = "cuda" if cuda_available() else "cpu"
        elif self.device == "cuda" and not cuda_available():
            import torch  # only to name the build in the error

            raise ConfigError("--device cuda: no CUDA GPU is visible to PyTorch here (torch "
                              f"{torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); use --device cpu")
        target = self.target_itl_ms
        if not isinstance(target, (int, float)) or not math.isfinite(target) or target < 0:
            raise ConfigError(f"--target-itl-ms must be a number of milliseconds >= 0 (0 = no target), "
                              f"not {target!r}")

    def _check_lora(self) -> None:
        self.lora_modules = tuple(LoRAModule.parse(m) for m in (self.lora_modules or ()))
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice: {', '.join(names)}")
        if self.lora_modules:
            self.enable_lora = True
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1")
        if self.max_lora_rank not in LORA_MAX_RANKS:
            raise ConfigError(f"--max-lora-rank must be one of {', '.join(map(str, LORA_MAX_RANKS))}, "
                              f"not {self.max_lora_rank}")
        if self.lora_dtype not in DTYPES:
            raise ConfigError(f"--lora-dtype must be one of {', '.join(DTYPES)}, not {self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                              f"({self.max_loras})")

    @property
    def lora_cache_size(self) -> int:
        """How many adapters stay in memory (vLLM's max_cpu_loras, default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def for_encoder(self) -> "EngineConfig":
        """This config for an encoder's engine: the encoder step size where no flag set it, no
        prefix caching (nothing is kept to share)."""
        step = {name: value for name, value in (("max_num_batched_tokens", ENCODER_MAX_NUM_BATCHED_TOKENS),
                                                ("max_num_seqs", ENCODER_MAX_NUM_SEQS))
                if name not in self.profile_overrides}
        return dataclasses.replace(self, enable_prefix_caching=False, **step)

    def pooler_for(self, model: ModelConfig) -> Optional[PoolerConfig]:
        """How this engine embeds with `model`: `--pooling` over the model's own pooler (a decoder
        given `--pooling` normalises, as vLLM's embedding runner does); None: it does not embed."""
        if self.pooling is None:
            return model.pooler
        base = model.pooler or PoolerConfig(self.pooling, matryoshka=model.matryoshka)
        return dataclasses.replace(base, pooling=self.pooling)

    @property
    def dense_copy(self) -> Optional[bool]:
        return {"auto": None, "on": True, "off": False}[self.dense_weight_copy]

    def profile_summary(self) -> str:
        """One line for the start-up log: the profile and the values it set or the flags beat."""
        def show(name: str) -> str:
            value = getattr(self, name)
            if name == "enable_prefix_caching":
                value = "on" if value else "off"
            elif name == "target_itl_ms":
                value = f"{value:g} ms" if value else "none"
            mark = " (flag)" if name in self.profile_overrides else ""
            return f"{name}={value}{mark}"
        return f"profile {self.profile}: " + ", ".join(show(n) for n in PROFILE_FIELDS)
