"""EngineArgs: every engine argument once, with vLLM's names, defaults and help texts.

`LLM(...)`'s keywords and the engine flags of `jaxserve generate`, `serve` and `plan` (and
their --help) are generated from this one dataclass, so the API and the command line cannot
drift apart. jaxserve's earlier names stay accepted as aliases (`num_kv_blocks` for vLLM's
`num_gpu_blocks_override`, `expert_parallel` for `enable_expert_parallel`). An unknown
keyword raises TypeError naming the accepted ones, as any Python function (vLLM's `LLM`
included) does. Values are checked where they are resolved: EngineConfig.create.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jaxserve.config.engine_config import (
    ATTENTION_BACKENDS,
    BACKENDS,
    DTYPE_CHOICES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
)
from jaxserve.config.pooler import CONVERTS, RUNNERS
from jaxserve.models.quantization import CHECKPOINT_METHODS

_PRECOMPILE = {"all": True, "background": "background", "lazy": False}


def _arg(default, help: str, *, choices=None, parse=None, aliases: tuple[str, ...] = (),
         short: tuple[str, ...] = (), cli_help: str | None = None, metavar: str | None = None,
         optional_value=None):
    """A field with what the CLI needs: help text, choices, a parser for the flag's text,
    old names (keywords and flags), short flags, and the value of the flag given without
    one (optional_value: `--hf-token` alone)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, choices=choices, parse=parse, aliases=aliases, short=short,
        cli_help=cli_help, metavar=metavar, optional_value=optional_value))


# The --help groups, named as vLLM's (`vllm serve --help=CacheConfig`), and their fields.
GROUPS = {
    "ModelConfig": ("model", "runner", "convert", "tokenizer", "revision",
                    "tokenizer_revision", "trust_remote_code", "dtype", "max_model_len", "seed",
                    "generation_config", "quantization", "max_logprobs", "hf_token",
                    "pooler_config"),
    "LoadConfig": ("load_format", "download_dir"),
    "CacheConfig": ("block_size", "num_gpu_blocks_override", "gpu_memory_utilization",
                    "kv_cache_memory_bytes", "enable_prefix_caching",
                    "disable_hybrid_kv_cache_manager", "kv_cache_dtype"),
    "SchedulerConfig": ("max_num_seqs", "max_num_batched_tokens", "scheduling_policy",
                        "async_scheduling"),
    "ParallelConfig": ("mesh", "tensor_parallel_size", "data_parallel_size",
                       "enable_expert_parallel"),
    "CompilationConfig": ("backend", "attention_backend", "compilation_cache_dir",
                          "precompile"),
    "SpeculativeConfig": ("speculative_config",),
    "AdmissionConfig": ("request_limits",),
    "LoRAConfig": ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
    "SleepConfig": ("enable_sleep_mode",),
}


def _cache_dir(text: str) -> str | None:
    return None if text.lower() == "none" else text


_SIZES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_int(text: str) -> int:
    """An integer, or one with vLLM's suffixes: k/m/g/t decimal (32k = 32000), K/M/G/T
    binary (32K = 32768), decimals allowed before a suffix (25.6k); GiB/GB spellings too
    (8GiB binary, 8GB decimal)."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgtKMGT])(i?)([bB]?))?\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 4096, 32k (32000) or 32K (32768), got {text!r}")
    number, suffix, binary, byte = match.groups()
    if suffix is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        return int(number)
    scale = _SIZES[suffix]
    if binary:  # 8Gi, 8GiB: binary whatever the case
        scale = _SIZES[suffix.upper()]
    elif byte:  # 8GB: decimal whatever the case, as disk and GPU vendors count
        scale = _SIZES[suffix.lower()]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _hf_token(text: str) -> str:
    return text


def _precompile(text: str):
    if text not in _PRECOMPILE:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(_PRECOMPILE)})")
    return _PRECOMPILE[text]


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """The engine's arguments. None means: resolved from the model and the platform."""

    model: str | None = _arg(
        None, "Hugging Face model folder (config.json, *.safetensors, tokenizer files); "
        "default: the built-in model")
    runner: str = _arg(
        "auto", "generate: a text-generation model; pooling: embeddings or classification "
        "(LLM.embed / classify / score); auto: pooling for *Model and "
        "*ForSequenceClassification checkpoints and folders with a sentence-transformers "
        "Pooling module, else generate", choices=RUNNERS)
    convert: str = _arg(
        "auto", "how a pooling runner uses the model: embed (pool the final hidden states; "
        "turns a *ForCausalLM into an embedding model), classify (a "
        "*ForSequenceClassification's head), none (a pooling architecture as it is); auto: "
        "classify for *ForSequenceClassification, else embed", choices=CONVERTS)
    tokenizer: str | None = _arg(
        None, "tokenizer folder or Hub id (default: the model's)")
    revision: str | None = _arg(
        None, "the Hub revision (branch, tag or commit) of a model given as a Hub id "
        "(default: the default branch)")
    tokenizer_revision: str | None = _arg(
        None, "the Hub revision of a tokenizer given as a Hub id (default: --revision when "
        "the tokenizer is the model's)")
    download_dir: str | None = _arg(
        None, "the Hugging Face cache folder to read and download Hub models into (default: "
        "$HF_HUB_CACHE, ~/.cache/huggingface/hub)")
    hf_token: str | bool | None = _arg(
        None, "the Hugging Face token for gated or private Hub models; given without a value: "
        "the token `hf auth login` stored (default: $HF_TOKEN or that stored token)",
        parse=_hf_token, metavar="TOKEN", optional_value=True)
    trust_remote_code: bool = _arg(
        False, "vLLM's permission to run code from the model folder; jaxserve never does (its "
        "own model code covers the supported architectures): accepted with a warning for a "
        "model that ships no code of its own, refused for one that does (auto_map)")
    dtype: str = _arg(
        "auto", "data type of weights and activations; auto: the checkpoint's on an "
        "accelerator, float32 on the CPU (unless the model is too large for it); half = "
        "float16, float = float32", choices=DTYPE_CHOICES)
    load_format: str = _arg(
        "auto", "auto: the model folder's safetensors (or its Orbax checkpoint); safetensors: "
        "the safetensors only; dummy: random weights of the model's shape, made on the "
        "devices (benchmarks)", choices=LOAD_FORMATS)
    max_model_len: int | None = _arg(
        None, "longest sequence (prompt + output) in tokens; 32k = 32000, 32K = 32768 "
        "(default: the model's max_position_embeddings, at most 8192 on an accelerator and "
        "2048 on the CPU)", parse=human_int)
    seed: int = _arg(0, "random seed of the engine (requests without a seed draw from it)")
    generation_config: str = _arg(
        "auto", "where the default sampling parameters come from: auto (the model folder's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens), vllm (ignore it), or a folder holding a generation_config.json; a "
        "request's own values win")
    block_size: int = _arg(16, "tokens per KV-cache block", choices=(8, 16, 32, 64, 128))
    num_gpu_blocks_override: int | None = _arg(
        None, "KV-cache size in blocks, instead of sizing it from the memory budget",
        aliases=("num_kv_blocks",))
    gpu_memory_utilization: float = _arg(
        0.9, "fraction of each accelerator's memory the engine may use (weights, KV cache)")
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV-cache budget in bytes per device, instead of gpu_memory_utilization: 8G or "
        "8GiB (binary), 8g or 8GB (decimal) (the CPU default is 1 GiB)", parse=human_int)
    enable_prefix_caching: bool = _arg(
        True, "reuse the KV cache of shared prompt prefixes")
    disable_hybrid_kv_cache_manager: bool = _arg(
        False, "keep the whole sequence's KV in sliding-window layers too (by default they "
        "hold only their window: config/kv_groups.py)")
    kv_cache_dtype: str = _arg(
        "auto", "data type of the KV cache: auto (the model's dtype); fp8 (= fp8_e4m3) or "
        "int8: one byte per element, twice the blocks of bfloat16, with a scale per layer "
        "and kv head calibrated at start-up", choices=KV_CACHE_DTYPES)
    max_num_seqs: int | None = _arg(
        None, "most sequences in one step (default 256 on an accelerator, 128 on the CPU)")
    max_num_batched_tokens: int | None = _arg(
        None, "most tokens in one step; 8k = 8000, 8K = 8192 (default 2048 on an "
        "accelerator, 512 on the CPU)", parse=human_int)
    scheduling_policy: str = _arg(
        "fcfs", "fcfs: first come, first served; priority: requests with a lower priority "
        "value go first, and the lowest-priority running request is preempted first",
        choices=SCHEDULING_POLICIES)
    async_scheduling: bool | None = _arg(
        None, "schedule each step while the previous one runs on the device, its inputs "
        "taken from that step's sampled tokens on the device, so host work overlaps device "
        "work; None: on, except with speculative decoding (which steps synchronously)",
        cli_help="schedule each step while the previous one runs on the device, so host work "
        "overlaps device work (default: on, except with speculative decoding)")
    mesh: str | None = _arg(
        None, "device mesh DATAxMODEL, e.g. 2x4 (or data=2,model=4): DATA replicas, each "
        "tensor-parallel over MODEL devices (default 1x1)")
    tensor_parallel_size: int = _arg(1, "the model axis of the mesh (vLLM's name)",
                                     short=("-tp",))
    data_parallel_size: int = _arg(1, "the data axis of the mesh (vLLM's name)",
                                   short=("-dp",))
    enable_expert_parallel: bool = _arg(
        False, "MoE models: split whole experts over the model axis instead of splitting "
        "every expert", aliases=("expert_parallel",))
    backend: str = _arg(
        "auto", "which framework runs the model: jax (auto; every mesh) or torch (PyTorch "
        "with Triton kernels on one NVIDIA/AMD GPU, or the CPU; needs the torch extra)",
        choices=BACKENDS)
    attention_backend: str = _arg(
        "auto", "auto: the Pallas kernel on TPU/GPU, XLA:CPU-tuned JAX on the CPU (torch "
        "backend: the Triton kernels on a GPU, the PyTorch reference on the CPU); pallas; "
        "reference; interpret / interpret-gpu (the TPU / GPU Pallas kernel in interpret "
        "mode, slow); torch backend: triton, triton-interpret (the Triton kernels in "
        "interpret mode on the CPU, slow)", choices=ATTENTION_BACKENDS)
    compilation_cache_dir: str | None = _arg(
        "default", "folder of the compiled-function caches (default "
        "$XDG_CACHE_HOME/jaxserve/xla or ~/.cache/jaxserve/xla; None / 'none' turns them "
        "off)", parse=_cache_dir)
    precompile: bool | str | None = _arg(
        None, "when to compile the shape buckets: True (all at start-up), 'background' (the "
        "first at start-up, the rest while serving) or False (each on first use); None: the "
        "entry point's default (LLM and generate: on first use, serve: background)",
        parse=_precompile, metavar="{" + ",".join(_PRECOMPILE) + "}", cli_help="when to compile the shape buckets: all (at start-up), "
        "background (the first at start-up, the rest while serving; serve's default) or "
        "lazy (each on first use; generate's default)")

    quantization: str | None = _arg(
        None, "int8: store the linear layers' weights as int8 with a float scale per output "
        "channel, quantized when they load (activations keep dtype; JAX backend). A "
        "checkpoint published quantized (its config.json's quantization_config: fp8, "
        "compressed-tensors, awq, gptq, mxfp4) is served as published without this flag; "
        "naming its format here only checks that it matches",
        choices=("int8",) + tuple(CHECKPOINT_METHODS), short=("-q",))
    max_logprobs: int | None = _arg(
        None, "the most logprobs (and prompt_logprobs) one request may ask for per token, at "
        "most 20 (default 20; the request limits max_logprobs and max_prompt_logprobs)")
    speculative_config: dict | str | None = _arg(
        None, "n-gram speculative decoding (prompt lookup), as vLLM's JSON: {\"method\": "
        "\"ngram\", \"num_speculative_tokens\": K, \"prompt_lookup_min\": a, "
        "\"prompt_lookup_max\": b}; each step verifies up to K tokens proposed from the "
        "sequence's own earlier tokens (JAX backend)", parse=str, metavar="JSON")
    pooler_config: dict | str | None = _arg(
        None, "a pooling model's pooler, as vLLM's JSON: {\"pooling_type\": \"LAST\" | "
        "\"MEAN\" | \"CLS\", \"normalize\": bool, \"dimensions\": int, "
        "\"use_activation\": bool} (default: the folder's sentence-transformers Pooling and "
        "Normalize modules, else LAST and normalized embeddings)", parse=str, metavar="JSON")
    enable_lora: bool = _arg(
        False, "serve LoRA adapters (PEFT folders) per request: LLM.generate(lora_request="
        "LoRARequest(...)), serve's --lora-modules and a request's model naming one (JAX "
        "backend)")
    max_loras: int = _arg(
        1, "LoRA adapters one step may use at once (device slots; requests for another "
        "adapter wait for a free slot)")
    max_lora_rank: int = _arg(
        16, "the largest LoRA rank served; every device slot is this wide (an adapter of a "
        "higher rank is refused)")
    max_cpu_loras: int | None = _arg(
        None, "LoRA adapters kept read in host memory, least recently used dropped first "
        "(default: max_loras)")
    enable_sleep_mode: bool = _arg(
        False, "allow LLM.sleep() / wake_up() (and serve's /sleep and /wake_up routes in "
        "development mode): free the KV cache and the weights' device memory between "
        "generation phases (JAX backend)")
    request_limits: dict | str | None = _arg(
        None, "what one request may ask for, as JSON of limit names to values, e.g. "
        "{\"max_n\": 32, \"max_stop_strings\": 64} (the others keep their defaults; the "
        "names and defaults: docs/architecture.md, 'Admission'); every front end checks "
        "them", parse=str, metavar="JSON")

    # ---- from keywords and from the command line ----------------------------------------
    @classmethod
    def from_kwargs(cls, caller: str = "EngineArgs", /, **kwargs: Any) -> EngineArgs:
        """Keywords with vLLM's names or jaxserve's aliases; TypeError for any other."""
        names = {f.name for f in dataclasses.fields(cls)}
        alias_of = {alias: f.name for f in dataclasses.fields(cls)
                    for alias in f.metadata["aliases"]}
        values: dict[str, Any] = {}
        unknown = []
        for key, value in kwargs.items():
            name = alias_of.get(key, key)
            if name not in names:
                unknown.append(key)
                continue
            if name in values:
                raise TypeError(f"{caller}() got both {name!r} and its alias {key!r}; give "
                                "one of them.")
            values[name] = value
        if unknown:
            accepted = sorted(names | set(alias_of))
            raise TypeError(f"{caller}() got unexpected keyword argument(s) "
                            f"{', '.join(map(repr, sorted(unknown)))}; the engine accepts "
                            f"{', '.join(accepted)}.")
        return cls(**values)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (--max-num-seqs for max_num_seqs), with its aliases, in
        vLLM's --help groups (GROUPS)."""
        group_of = {name: group for group, names in GROUPS.items() for name in names}
        groups = {}
        for f in dataclasses.fields(cls):
            title = group_of[f.name]  # KeyError: a new field needs its group in GROUPS
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            _add_field(groups[title], f)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def model_folder(self, logger) -> str:
        """self.model as a local folder: the built-in model when None, a Hub id from the
        Hugging Face cache (downloaded when missing) at --revision, in --download-dir, with
        --hf-token."""
        from jaxserve.config.model_path import resolve_model

        return resolve_model(self.model, logger, **self._hub(self.revision))

    def _hub(self, revision: str | None) -> dict:
        return dict(revision=revision, cache_dir=self.download_dir, token=self.hf_token)

    def engine_config(self, model: str, *, on_accelerator: bool,
                      default_precompile: bool | str = True):
        """The resolved EngineConfig for a model folder (self.model resolved by the
        caller with model_folder: the built-in model when None)."""
        import logging

        from jaxserve.config.engine_config import EngineConfig
        from jaxserve.config.model_path import resolve_model
        from jaxserve.config.request_limits import RequestLimits

        if self.trust_remote_code:
            _check_remote_code(model)
        precompile = self.precompile if self.precompile is not None else default_precompile
        tokenizer = self.tokenizer
        if tokenizer is not None and tokenizer != self.model:
            tokenizer = resolve_model(tokenizer, logging.getLogger("jaxserve"),
                                      **self._hub(self.tokenizer_revision))
        elif self.tokenizer_revision not in (None, self.revision):
            raise ValueError("tokenizer_revision differs from revision, but the tokenizer is "
                             "the model's own files; give --tokenizer ID to load another "
                             "revision's tokenizer.")
        limits = self.request_limits
        if self.max_logprobs is not None:
            if not 0 <= self.max_logprobs <= 20:
                raise ValueError(f"max_logprobs must be in 0..20 (the top-k the device step "
                                 f"computes), got {self.max_logprobs}.")
            limits = dataclasses.asdict(RequestLimits.parse(limits).replace(
                max_logprobs=self.max_logprobs, max_prompt_logprobs=self.max_logprobs))
        return EngineConfig.create(
            model, tokenizer=tokenizer, dtype=self.dtype, load_format=self.load_format,
            max_model_len=self.max_model_len, seed=self.seed, block_size=self.block_size,
            num_kv_blocks=self.num_gpu_blocks_override,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager,
            kv_cache_dtype=self.kv_cache_dtype, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, mesh=self.mesh,
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            expert_parallel=self.enable_expert_parallel,
            attention_backend=self.attention_backend, backend=self.backend,
            compilation_cache_dir=self.compilation_cache_dir, precompile=precompile,
            generation_config=self.generation_config,
            scheduling_policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
            speculative_config=self.speculative_config, quantization=self.quantization,
            request_limits=limits, runner=self.runner, convert=self.convert,
            pooler_config=self.pooler_config, enable_lora=self.enable_lora,
            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras, enable_sleep_mode=self.enable_sleep_mode,
            on_accelerator=on_accelerator)


_TYPES = {"int": int, "float": float, "str": str}


def _check_remote_code(model: str) -> None:
    """trust_remote_code=True: harmless (a warning) when the model's config.json maps no
    classes to code of its own; a ValueError when it does, since that code would not run."""
    import json
    import logging
    import pathlib

    try:
        auto_map = json.loads((pathlib.Path(model) / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        auto_map = None  # the config's own check says what is wrong with it
    if auto_map:
        raise ValueError(f"trust_remote_code=True, and {model}'s config.json maps classes to "
                         f"code of its own (auto_map: {', '.join(sorted(auto_map))[:120]}); "
                         "jaxserve never runs code from a model folder, so such a model is "
                         "served only if its architecture is one jaxserve implements: drop "
                         "trust_remote_code to serve it with jaxserve's own implementation.")
    logging.getLogger("jaxserve").warning(
        "trust_remote_code=True: ignored; jaxserve runs its own implementation of the model's "
        "architecture and never code from the model folder (this one ships none).")


def _add_field(group, f: dataclasses.Field) -> None:
    meta = f.metadata
    flags = [_flag(f.name), *(_flag(a) for a in meta["aliases"]), *meta["short"]]
    help_text = meta["cli_help"] or meta["help"]
    if isinstance(f.default, bool) or str(f.type).startswith("bool | None"):
        group.add_argument(*flags, dest=f.name, default=f.default,
                           action=argparse.BooleanOptionalAction, help=help_text)
        return
    # The annotation's first type ("int | None" -> int) reads the flag's text.
    kind = meta["parse"] or _TYPES[str(f.type).split("|")[0].strip()]
    choices = None if meta["parse"] else meta["choices"]
    if choices is not None:
        choices = list(choices)
    extra = {} if meta["optional_value"] is None else dict(nargs="?",
                                                           const=meta["optional_value"])
    group.add_argument(*flags, dest=f.name, default=f.default, type=kind, choices=choices,
                       metavar=meta["metavar"], help=help_text + _default_text(f.default),
                       **extra)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _default_text(default) -> str:
    return "" if default is None else f" (default: {default})"
