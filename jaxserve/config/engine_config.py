"""Engine configuration: one frozen dataclass per concern, composed by EngineConfig.

Argument names follow vLLM's engine arguments so that a vLLM user's call works unchanged.
Every value is checked here, once, with a message that says what would be accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

# (BACKENDS and the attention implementations' names stay importable from here)
from jaxserve.config.backend_capabilities import (  # noqa: F401
    ATTENTION_BACKENDS,
    BACKENDS,
    JAX_ATTENTION_BACKENDS,
    TORCH_ATTENTION_BACKENDS,
    check_config,
    resolve_backend,
)
from jaxserve.config.generation_config import load_json, sampling_defaults
from jaxserve.config.lora import LoraConfig
from jaxserve.config.mesh import MeshShape, ModelDims, parse_mesh, plan_sharding
from jaxserve.config.pooler import PoolerConfig, resolve_pooler
from jaxserve.config.request_limits import RequestLimits
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.models import resolve_architecture
from jaxserve.models.deepseek_arch import check_latent_attention
from jaxserve.models.gemma_arch import language_model_config
from jaxserve.models.quantization import check_quantization, checkpoint_scheme

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
ORBAX_MARKER = "jaxserve_orbax.json"  # in a `jaxserve convert` folder (orbax_checkpoint.py)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names
DTYPE_CHOICES = SUPPORTED_DTYPES + tuple(DTYPE_ALIASES)
# auto: the folder's safetensors or its Orbax checkpoint; safetensors: the former only (as
# vLLM's flag); dummy: random weights of the model's shape.
LOAD_FORMATS = ("auto", "safetensors", "dummy")
PRECOMPILE = (True, False, "background")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    max_model_len: int
    seed: int
    hf_config: dict = dataclasses.field(repr=False, compare=False, hash=False)
    # auto: the folder's safetensors; dummy: random weights made on the devices (benchmarks
    # of a model's shape without its checkpoint, as vLLM's --load-format dummy)
    load_format: str = "auto"
    # SamplingParams fields the model's generation_config.json sets (generation_config.py)
    sampling_defaults: dict = dataclasses.field(default_factory=dict, compare=False,
                                                hash=False)
    # "int8": linear weights as int8 (quantization.py); or the checkpoint's own format's
    # name, which must match its quantization_config (weights_scheme)
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        checkpoint_scheme(self.quantization, self.hf_config, self.model)  # fails before loading
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got "
                             f"{self.load_format!r}; jaxserve reads Hugging Face safetensors "
                             "folders and its own Orbax conversions (pt, gguf, bitsandbytes, "
                             "tensorizer and the others are not supported).")
        if self.load_format == "safetensors" and self.is_orbax:
            raise ValueError(f"load_format='safetensors', but {self.model} is an Orbax "
                             "checkpoint (jaxserve convert); use load_format='auto'.")

    @property
    def is_orbax(self) -> bool:
        """Whether the folder is an Orbax checkpoint (`jaxserve convert`)."""
        return (Path(self.model) / ORBAX_MARKER).is_file()

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def weights_scheme(self):
        """What the linear layers' weights are: None (float), "int8" (quantized while
        loading) or the checkpoint's LinearQuant (models/quant_config.py)."""
        return checkpoint_scheme(self.quantization, self.hf_config, self.model)

    @property
    def weights_label(self) -> str | None:
        """What the start-up log calls weights_scheme (None: float weights)."""
        scheme = self.weights_scheme
        return "int8 linear layers" if scheme == "int8" else getattr(scheme, "label", None)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from the memory budget
    gpu_memory_utilization: float = 0.9  # fraction of accelerator memory the engine may use
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (the CPU default is 1 GiB)
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared by prompts
    # auto: the model's dtype; fp8 (= fp8_e4m3) or int8: one byte per element with a
    # float32 scale per layer and kv head, calibrated at start-up (docs/architecture.md)
    kv_cache_dtype: str = "auto"
    # sliding-window layers hold only their window (config/kv_groups.py); False: everything
    hybrid_kv_cache: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.hybrid_kv_cache, bool):
            raise ValueError("hybrid_kv_cache (disable_hybrid_kv_cache_manager) must be True "
                             f"or False, got {self.hybrid_kv_cache!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}.")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError("enable_prefix_caching must be True or False, got "
                             f"{self.enable_prefix_caching!r}.")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # fcfs: first come, first served (a request's priority must be 0); priority: waiting
    # requests by priority (lower first), and the lowest-priority running request is the
    # one preempted (vLLM's --scheduling-policy).
    policy: str = "fcfs"
    # Schedule and launch step N+1 while step N runs, its placeholder inputs taken from N's
    # sampled tokens on the device (vLLM's async_scheduling); False: each step is scheduled
    # after the previous one's tokens reached the host.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {self.policy!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs a token slot.")

    @functools.cached_property  # read every step by pick_bucket: computed once
    def token_buckets(self) -> tuple[int, ...]:
        """T buckets: powers of two from 16 up to max_num_batched_tokens (always included)."""
        return _power_buckets(16, self.max_num_batched_tokens)

    @functools.cached_property
    def step_buckets(self) -> tuple[tuple[int, int], ...]:
        """The compiled (T, R) shapes.

        R follows T (R = min(T, max_num_seqs)): a step of T tokens rarely has far fewer
        sequences than tokens, except prefill-heavy steps, where the extra rows cost little
        next to the T-token forward pass. Only the smallest T, where decode steps of a few
        sequences land, gets every power-of-two R, so that one or two streams do not pay
        for sampling a full row set. This keeps start-up compilation to about
        len(T buckets) + log2(R) functions instead of their product.
        """
        tokens = self.token_buckets
        smallest = min(tokens[0], self.max_num_seqs)
        pairs = [(tokens[0], r) for r in _power_buckets(1, smallest)]
        pairs += [(t, min(t, self.max_num_seqs)) for t in tokens[1:]]
        return tuple(dict.fromkeys(pairs))

    def pick_bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest compiled (T, R) that holds a step of num_tokens from num_seqs."""
        for t, r in self.step_buckets:
            if t >= num_tokens and r >= num_seqs:
                return t, r
        raise ValueError(f"a step of {num_tokens} tokens from {num_seqs} sequences exceeds "
                         f"max_num_batched_tokens={self.max_num_batched_tokens} / "
                         f"max_num_seqs={self.max_num_seqs}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Device placement: the (data, model) mesh (config/mesh.py) and whether MoE experts are
    split whole over the model axis (expert parallelism) instead of inside each expert."""

    mesh: MeshShape = MeshShape()
    expert_parallel: bool = False

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.model


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which ragged paged attention the step runs (attend.attention_for resolves it on the
    JAX backend, backends/torch/attend.py's make_attend on the torch backend).

    JAX backend: auto: the Pallas kernel on TPU and GPU, the XLA:CPU-tuned pure-JAX version
    on the CPU; pallas: the platform's Pallas kernel (TPU or GPU only); reference: the
    pure-JAX reference; interpret / interpret-gpu: the TPU / GPU kernel in Pallas interpret
    mode (any platform, slow: for testing a kernel end to end).
    Torch backend: auto: the Triton kernels on a GPU, the PyTorch reference on the CPU;
    triton (GPU only); reference; triton-interpret: the Triton kernels in interpret mode
    (the CPU, slow).
    """

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.backend!r}.")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    attention: AttentionConfig = AttentionConfig()
    backend: str = "jax"  # resolved: jax | torch
    compilation_cache_dir: str | None = None
    # True: compile every bucket at start-up; False: each on first use; "background": the
    # first bucket at start-up, the others in a thread while steps run on compiled ones
    precompile: bool | str = True
    speculative: SpeculativeConfig | None = None  # n-gram speculative decoding (None: off)
    # What one request may ask for: every front end checks it (admission.py).
    limits: RequestLimits = RequestLimits()
    # A pooling engine's settings (embeddings, classification: config/pooler.py); None: the
    # engine generates.
    pooler: PoolerConfig | None = None
    lora: LoraConfig | None = None  # LoRA adapters served per request (None: off)
    enable_sleep_mode: bool = False  # LLM.sleep / wake_up allowed (vLLM's flag)

    def __post_init__(self) -> None:
        """The sub-configs' combination (each checked its own fields)."""
        if self.lora is not None and self.pooler is not None:
            raise ValueError("enable_lora: a pooling model (runner='pooling') serves no LoRA "
                             "adapters; drop enable_lora.")
        if self.pooler is not None and self.speculative is not None:
            raise ValueError("speculative_config: a pooling model (runner='pooling') "
                             "generates no tokens to speculate on; drop speculative_config.")
        if self.precompile not in PRECOMPILE:
            raise ValueError(f"precompile must be True, False or 'background', got "
                             f"{self.precompile!r}.")
        # what the backend lacks: its model families, attention, features
        # (backend_capabilities.py's table)
        check_config(self)
        if self.model.quantization is not None and self.model.is_orbax:
            raise ValueError("quantization: an Orbax checkpoint (jaxserve convert) is restored "
                             "as saved; quantize from the Hugging Face folder instead.")
        if self.scheduler.async_scheduling and self.speculative is not None:
            raise ValueError("async_scheduling=True does not work with speculative_config: a "
                             "speculative step's next inputs depend on how many proposals it "
                             "accepts. Drop one of them (speculative decoding steps "
                             "synchronously when async_scheduling is left unset).")
        check_latent_attention(self)

    @classmethod
    def create(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        hybrid_kv_cache: bool = True,
        kv_cache_dtype: str = "auto",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        mesh: str | MeshShape | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        expert_parallel: bool = False,
        attention_backend: str = "auto",
        backend: str = "auto",
        compilation_cache_dir: str | None = "default",
        precompile: bool | str = True,
        generation_config: str = "auto",
        scheduling_policy: str = "fcfs",
        async_scheduling: bool | None = None,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        quantization: str | None = None,
        request_limits: RequestLimits | dict | str | None = None,
        runner: str = "auto",
        convert: str = "auto",
        pooler_config: dict | str | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        enable_sleep_mode: bool = False,
        on_accelerator: bool = False,
    ) -> EngineConfig:
        """Resolve defaults against the model folder's config.json and validate everything,
        in stages: read the model folder; resolve the settings that default from it, the
        platform or each other; derive the sub-configs (each checks its own fields); check
        their combination (__post_init__)."""
        hf_config = read_model_folder(model)
        # the settings that default from the folder, the platform or each other
        pooler = resolve_pooler(runner, convert, pooler_config, hf_config, model)
        resolved_dtype = _resolve_dtype(dtype, hf_config, model, on_accelerator)
        max_model_len = _resolve_max_model_len(max_model_len, hf_config, on_accelerator)
        if max_num_seqs is None:
            max_num_seqs = 256 if on_accelerator else 128
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 2048 if on_accelerator else 512
        speculative = SpeculativeConfig.parse(speculative_config)
        async_scheduling = _resolve_async_scheduling(async_scheduling, speculative)
        compilation_cache_dir = _resolve_compilation_cache_dir(compilation_cache_dir)
        # the sub-configs, then their combination checked by __post_init__
        return cls(
            model=ModelConfig(model=str(model), tokenizer=str(tokenizer or model),
                              dtype=resolved_dtype, max_model_len=max_model_len, seed=seed,
                              hf_config=hf_config, load_format=load_format,
                              sampling_defaults=sampling_defaults(str(model),
                                                                  generation_config),
                              quantization=check_quantization(quantization)),
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                              gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              enable_prefix_caching=enable_prefix_caching,
                              hybrid_kv_cache=hybrid_kv_cache, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, policy=scheduling_policy,
                                      async_scheduling=async_scheduling),
            parallel=_parallel_config(hf_config, mesh, data_parallel_size,
                                      tensor_parallel_size, expert_parallel),
            attention=AttentionConfig(backend=attention_backend),
            backend=resolve_backend(backend),
            compilation_cache_dir=compilation_cache_dir,
            precompile=precompile,
            speculative=speculative,
            limits=RequestLimits.parse(request_limits),
            pooler=pooler,
            lora=LoraConfig.create(enable_lora, max_loras, max_lora_rank, max_cpu_loras),
            enable_sleep_mode=_check_switch("enable_sleep_mode", enable_sleep_mode),
        )


def read_model_folder(model: str | os.PathLike) -> dict:
    """create's first stage: the folder's config.json (read_hf_config), of an architecture
    jaxserve serves (ValueError listing them otherwise)."""
    hf_config = read_hf_config(model)
    resolve_architecture(hf_config)
    return hf_config


def _resolve_max_model_len(max_model_len: int | None, hf_config: dict,
                           on_accelerator: bool) -> int:
    """None: the model's max_position_embeddings, at most 8192 on an accelerator and 2048
    on the CPU; a given length must fit the model."""
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    if max_model_len is None:
        max_model_len = min(limit, 8192 if on_accelerator else 2048)
    if not isinstance(max_model_len, int) or max_model_len < 2:
        raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}.")
    if max_model_len > limit:
        raise ValueError(f"max_model_len ({max_model_len}) is larger than the model's "
                         f"max_position_embeddings ({limit}); use at most {limit}.")
    return max_model_len


def _resolve_async_scheduling(async_scheduling: bool | None,
                              speculative: SpeculativeConfig | None) -> bool:
    """None (auto): on unless speculative decoding is, which steps synchronously."""
    if async_scheduling not in (None, True, False):
        raise ValueError(f"async_scheduling must be True, False or None (auto), got "
                         f"{async_scheduling!r}.")
    return speculative is None if async_scheduling is None else async_scheduling


def _resolve_compilation_cache_dir(folder: str | None) -> str | None:
    """The folder "default" names: $XDG_CACHE_HOME/jaxserve/xla (~/.cache when unset);
    None: off."""
    if folder != "default":
        return folder
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(cache_home, "jaxserve", "xla")


def _check_switch(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


def _parallel_config(hf_config: dict, mesh, data_parallel_size: int, tensor_parallel_size: int,
                     expert_parallel: bool) -> ParallelConfig:
    """The mesh from `mesh` or vLLM's data/tensor_parallel_size, checked against the model
    now (heads, kv heads, widths, experts), so a bad split fails before anything loads."""
    sizes = MeshShape(data_parallel_size, tensor_parallel_size)
    shape = parse_mesh(mesh) if mesh is not None else parse_mesh(sizes)
    if mesh is not None and sizes != MeshShape() and sizes != shape:
        raise ValueError(f"mesh={str(mesh)!r} contradicts data_parallel_size="
                         f"{data_parallel_size} / tensor_parallel_size={tensor_parallel_size}; "
                         "give one of them.")
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"expert_parallel must be True or False, got {expert_parallel!r}.")
    dims = ModelDims.from_hf(hf_config)
    if expert_parallel and not dims.num_experts:
        raise ValueError("expert_parallel needs a mixture-of-experts model; this one is dense.")
    plan_sharding(dims, shape.model, expert_parallel)  # raises with the sizes that work
    return ParallelConfig(mesh=shape, expert_parallel=expert_parallel)


def read_hf_config(model: str | os.PathLike) -> dict:
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(f"model must be a Hugging Face model folder or Hub id (org/name); "
                         f"{str(model)!r} is not a directory.")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; expected a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files).")
    # (a multimodal folder as its language model: every reader of the config sees that;
    # NaN or Infinity anywhere in the file is refused, naming its key)
    return language_model_config(load_json(path))


def _resolve_dtype(dtype: str, hf_config: dict, model: str, on_accelerator: bool) -> str:
    """auto: the checkpoint's dtype on an accelerator. On the CPU, float32 (XLA:CPU has no
    bf16 matmul: it converts the weights to f32 at every step, and bf16 decode steps measured
    1.24-2.08x slower than f32 ones, scripts/bench_cpu_dtype.py), unless the f32 weights would
    take more than a quarter of the host's memory: then the checkpoint's dtype."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}.")
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    # MXFP4 checkpoints (GPT-OSS) dequantize to bfloat16, the dtype of their other tensors
    mxfp4 = (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    saved = (hf_config.get("dtype") or hf_config.get("torch_dtype")
             or ("bfloat16" if mxfp4 else "float32"))
    saved = saved if saved in SUPPORTED_DTYPES[1:] else "float32"
    if on_accelerator or saved == "float32":
        return saved
    f32_bytes = 2 * sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))
    return "float32" if f32_bytes <= _host_memory_bytes() // 4 else saved


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _power_buckets(low: int, high: int) -> tuple[int, ...]:
    buckets = []
    size = low
    while size < high:
        buckets.append(size)
        size *= 2
    buckets.append(high)
    return tuple(buckets)
