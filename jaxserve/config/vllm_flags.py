"""`vllm serve` flags that jaxserve has no flag of its own for, so that a launch script
written for vLLM gets an answer instead of argparse's "unrecognized arguments".

Each is either accepted with one WARNING, where it truly has no meaning here (`--enforce-eager`:
there is no eager mode to force), or refused with a sentence that says what jaxserve lacks
(`-pp 2`: no pipeline parallelism). Some are accepted for some values only (`-pp 1`,
`--cpu-offload-gb 0`). The flags jaxserve implements are its own (engine_args.py, the serve
parser in jaxserve/cli/serve.py); tests/config/test_vllm_flags.py walks vLLM's list against both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

SWITCH, VALUE, VALUES = "switch", "value", "values"  # --flag / --no-flag; --flag V; --flag V..


@dataclasses.dataclass(frozen=True)
class CompatFlag:
    """flags: the spellings; kind: SWITCH, VALUE or VALUES (one or more); ignored: why it has no meaning here
    (the warning), for the values `accepts` takes; lacks: what jaxserve lacks (the
    refusal), for every other value (None: every value is accepted)."""

    flags: tuple[str, ...]
    kind: str
    ignored: str | None = None
    lacks: str | None = None
    accepts: Callable[[Any], bool] = lambda value: True

    @property
    def dest(self) -> str:
        return "vllm_" + self.flags[0].lstrip("-").replace("-", "_")


def _is(*values) -> Callable[[Any], bool]:
    return lambda value: value in values


def _num_at_most(limit: float) -> Callable[[Any], bool]:
    def accepts(value) -> bool:
        try:
            return float(value) <= limit
        except ValueError:
            return False
    return accepts


def _all_zero(value) -> bool:
    """A JSON object of per-modality limits that are all 0 (text only)."""
    try:
        limits = json.loads(value)
    except ValueError:
        return False
    return isinstance(limits, dict) and not any(
        (v.get("count", 1) if isinstance(v, dict) else v) for v in limits.values())


_NOT_SWITCHED_ON = _is(False)
_TEXT_ONLY = ("jaxserve serves text models' language side only: no image, audio or video "
              "inputs")
_NO_LORA_SHARDING = ("jaxserve splits each LoRA weight the way its base kernel is split on "
                     "the mesh")
_TASK = ("--task is vLLM's older flag: use --runner pooling with --convert embed or "
         "--convert classify (or --runner generate)")
_HOSTS = ("jaxserve places data-parallel replicas itself: give the whole mesh (--mesh DxM or "
          "-dp/-tp) and join the hosts with --coordinator/--num-hosts/--host-id or "
          "--multi-host; every host runs the same command")
_XLA = ("jaxserve compiles each shape bucket of its step with XLA (see `jaxserve plan`); "
        "vLLM's eager mode, torch.compile and CUDA graph settings have no counterpart")

FLAGS: tuple[CompatFlag, ...] = (
    # ---- ModelConfig
    CompatFlag(("--task",), VALUE, "--task is vLLM's older flag: --runner (auto by default) "
               "chooses generation", _TASK, _is("auto", "generate")),
    CompatFlag(("--tokenizer-mode",), VALUE, "jaxserve always uses the fast (Rust) tokenizer",
               "jaxserve loads tokenizers with Hugging Face tokenizers only (no slow, mistral "
               "or custom tokenizer modes)", _is("auto", "hf")),
    CompatFlag(("--hf-config-path",), VALUE, lacks="jaxserve reads config.json from the "
               "model folder only; copy the folder and edit its config.json"),
    CompatFlag(("--code-revision",), VALUE, lacks="jaxserve never runs code from a model "
               "repository, so there is no code revision to choose"),
    CompatFlag(("--allowed-local-media-path",), VALUE, lacks=_TEXT_ONLY),
    CompatFlag(("--allowed-media-domains",), VALUE, lacks=_TEXT_ONLY),
    CompatFlag(("--enforce-eager",), SWITCH, _XLA),
    CompatFlag(("--max-seq-len-to-capture",), VALUE, _XLA),
    CompatFlag(("--logprobs-mode",), VALUE, "jaxserve's logprobs are the model's raw "
               "log-softmax, before any sampling transformation",
               "jaxserve returns raw logprobs only (processed logprobs and logits are not "
               "available)", _is("raw_logprobs")),
    CompatFlag(("--disable-sliding-window",), SWITCH, "sliding windows stay on",
               "jaxserve always applies a model's sliding window (no switch to full "
               "attention capped at the window size)", _NOT_SWITCHED_ON),
    CompatFlag(("--disable-cascade-attn",), SWITCH, "jaxserve has no cascade attention to "
               "turn off"),
    CompatFlag(("--skip-tokenizer-init",), SWITCH, "the tokenizer loads",
               "jaxserve needs the tokenizer (stop strings, chat templates, structured "
               "outputs, detokenized text)", _NOT_SWITCHED_ON),
    CompatFlag(("--enable-prompt-embeds",), SWITCH, "prompt embeddings stay off",
               "jaxserve takes prompts as text or token ids, not embeddings", _NOT_SWITCHED_ON),
    CompatFlag(("--config-format",), VALUE, "jaxserve reads Hugging Face config.json",
               "jaxserve reads Hugging Face config.json only (no Mistral params.json)",
               _is("auto", "hf")),
    CompatFlag(("--hf-overrides",), VALUE, lacks="jaxserve reads config.json as published; "
               "copy the folder and edit its config.json"),
    CompatFlag(("--override-generation-config",), VALUE, lacks="jaxserve takes default "
               "sampling parameters from a generation_config.json: put one in a folder and "
               "give --generation-config FOLDER"),
    CompatFlag(("--model-impl",), VALUE, "jaxserve runs its own model code",
               "jaxserve runs its own implementation of each supported architecture (no "
               "transformers or other model implementations)", _is("auto", "vllm")),
    CompatFlag(("--override-attention-dtype",), VALUE, lacks="jaxserve's attention runs in "
               "the model's dtype (--dtype), with no separate attention dtype"),
    CompatFlag(("--logits-processors",), VALUE, lacks="jaxserve does not load custom logits "
               "processors"),
    CompatFlag(("--io-processor-plugin",), VALUE, lacks="jaxserve loads no IO processor "
               "plugins (prompts are text or token ids, outputs text)"),
    # ---- LoadConfig
    CompatFlag(("--safetensors-load-strategy",), VALUE, "jaxserve reads safetensors files "
               "through memory maps, tensor by tensor"),
    CompatFlag(("--model-loader-extra-config",), VALUE, lacks="jaxserve's loader takes no "
               "extra configuration"),
    CompatFlag(("--ignore-patterns",), VALUES, "jaxserve reads only config, tokenizer and "
               "safetensors files"),
    CompatFlag(("--use-tqdm-on-load",), SWITCH, "jaxserve serve reports loading progress "
               "as log lines"),
    CompatFlag(("--pt-load-map-location",), VALUE, lacks="jaxserve does not read PyTorch .pt "
               "or .bin checkpoints (safetensors only)"),
    # ---- CacheConfig
    CompatFlag(("--swap-space",), VALUE, "jaxserve preempts by recomputing and swaps no KV "
               "cache to host memory"),
    CompatFlag(("--cpu-offload-gb",), VALUE, "no weights are offloaded",
               "jaxserve keeps all weights in device memory (no CPU offload)", _num_at_most(0)),
    CompatFlag(("--calculate-kv-scales",), SWITCH, "jaxserve always calibrates fp8/int8 KV "
               "scales at start-up"),
    CompatFlag(("--prefix-caching-hash-algo",), VALUE, "jaxserve hashes prefix blocks its "
               "own way"),
    CompatFlag(("--kv-sharing-fast-prefill",), SWITCH, "the option stays off",
               "jaxserve has no KV-sharing fast prefill", _NOT_SWITCHED_ON),
    CompatFlag(("--mamba-cache-dtype",), VALUE, lacks="jaxserve serves no Mamba or hybrid "
               "state-space models"),
    CompatFlag(("--mamba-ssm-cache-dtype",), VALUE, lacks="jaxserve serves no Mamba or "
               "hybrid state-space models"),
    CompatFlag(("--kv-offloading-size",), VALUE, lacks="jaxserve does not offload the KV "
               "cache to host memory"),
    CompatFlag(("--kv-offloading-backend",), VALUE, lacks="jaxserve does not offload the KV "
               "cache to host memory"),
    # ---- ParallelConfig
    CompatFlag(("--distributed-executor-backend",), VALUE, "jaxserve's hosts join through "
               "jax.distributed (--coordinator or --multi-host)", "jaxserve does not run on "
               "Ray: " + _HOSTS, _is("mp", "uni", "external_launcher")),
    CompatFlag(("--pipeline-parallel-size", "-pp"), VALUE, "one pipeline stage is what "
               "jaxserve runs", "jaxserve has no pipeline parallelism; split a model that "
               "does not fit one device with tensor parallelism (-tp, or --mesh 1xN)",
               _is("1")),
    CompatFlag(("--decode-context-parallel-size", "-dcp"), VALUE, "no context parallelism "
               "is asked for", "jaxserve has no decode context parallelism", _is("1")),
    CompatFlag(("--data-parallel-rank", "-dpn"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-start-rank", "-dpr"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-size-local", "-dpl"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-address", "-dpa"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-rpc-port", "-dpp"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-backend", "-dpb"), VALUE, lacks=_HOSTS),
    CompatFlag(("--data-parallel-hybrid-lb",), SWITCH, "replicas stay behind one front end",
               _HOSTS, _NOT_SWITCHED_ON),
    CompatFlag(("--data-parallel-external-lb",), SWITCH, "replicas stay behind one front end",
               _HOSTS + "; for a load balancer in front of separate servers, start one "
               "`jaxserve serve` per replica (docs/deployment.md)", _NOT_SWITCHED_ON),
    CompatFlag(("--headless",), SWITCH, "this process serves", _HOSTS, _NOT_SWITCHED_ON),
    CompatFlag(("--api-server-count", "-asc"), VALUE, "one API server process is what "
               "jaxserve runs", "jaxserve runs one API server process per engine (the engine "
               "steps in a process of its own); scale out with more replicas behind a "
               "router", _is("1")),
    CompatFlag(("--enable-eplb",), SWITCH, "expert load balancing stays off",
               "jaxserve has no expert-parallel load balancing", _NOT_SWITCHED_ON),
    CompatFlag(("--eplb-config",), VALUE, lacks="jaxserve has no expert-parallel load "
               "balancing"),
    CompatFlag(("--expert-placement-strategy",), VALUE, "jaxserve places experts linearly",
               "jaxserve places experts linearly over the model axis only",
               _is("linear")),
    CompatFlag(("--max-parallel-loading-workers",), VALUE, "jaxserve reads the weights on "
               "one thread per host, tensor by tensor"),
    CompatFlag(("--ray-workers-use-nsight",), SWITCH, "there are no Ray workers",
               "jaxserve does not run on Ray", _NOT_SWITCHED_ON),
    CompatFlag(("--disable-custom-all-reduce",), SWITCH, "XLA chooses the collectives"),
    CompatFlag(("--worker-cls",), VALUE, lacks="jaxserve has no pluggable worker classes"),
    CompatFlag(("--worker-extension-cls",), VALUE, lacks="jaxserve has no pluggable worker "
               "classes"),
    CompatFlag(("--enable-dbo",), SWITCH, "dual-batch overlap stays off",
               "jaxserve has no dual-batch overlap", _NOT_SWITCHED_ON),
    CompatFlag(("--all2all-backend",), VALUE, "XLA chooses the collectives of expert "
               "parallelism"),
    CompatFlag(("--enable-multimodal-encoder-data-parallel",), SWITCH, "there is no "
               "multimodal encoder", _TEXT_ONLY, _NOT_SWITCHED_ON),
    # ---- MultiModalConfig
    CompatFlag(("--limit-mm-per-prompt",), VALUE, "every media limit is 0, and jaxserve "
               "takes text only", _TEXT_ONLY, _all_zero),
    CompatFlag(("--media-io-kwargs",), VALUE, lacks=_TEXT_ONLY),
    CompatFlag(("--mm-processor-kwargs",), VALUE, lacks=_TEXT_ONLY),
    CompatFlag(("--mm-processor-cache-gb",), VALUE, "there is no multimodal processor",
               _TEXT_ONLY),
    CompatFlag(("--disable-mm-preprocessor-cache",), SWITCH, "there is no multimodal "
               "preprocessor"),
    CompatFlag(("--mm-encoder-tp-mode",), VALUE, "there is no multimodal encoder"),
    CompatFlag(("--interleave-mm-strings",), SWITCH, "there are no multimodal inputs",
               _TEXT_ONLY, _NOT_SWITCHED_ON),
    CompatFlag(("--skip-mm-profiling",), SWITCH, "there is no multimodal encoder to "
               "profile"),
    # ---- LoRAConfig
    CompatFlag(("--lora-dtype",), VALUE, "LoRA weights take the model's dtype",
               "LoRA weights are kept in the model's dtype", _is("auto")),
    CompatFlag(("--fully-sharded-loras",), SWITCH, "LoRA weights are split as their base "
               "kernels are", _NO_LORA_SHARDING, _NOT_SWITCHED_ON),
    CompatFlag(("--enable-lora-bias",), SWITCH, "LoRA bias stays off",
               "jaxserve's LoRA adapters have no bias terms (PEFT's bias='none')",
               _NOT_SWITCHED_ON),
    CompatFlag(("--default-mm-loras",), VALUE, lacks=_TEXT_ONLY),
    # ---- ObservabilityConfig
    CompatFlag(("--show-hidden-metrics-for-version",), VALUE, "jaxserve hides no deprecated "
               "metrics"),
    CompatFlag(("--otlp-traces-endpoint",), VALUE, lacks="jaxserve exports no OpenTelemetry "
               "traces (Prometheus metrics at /metrics)"),
    CompatFlag(("--collect-detailed-traces",), VALUE, lacks="jaxserve exports no "
               "OpenTelemetry traces (Prometheus metrics at /metrics)"),
    CompatFlag(("--kv-cache-metrics",), SWITCH, "jaxserve's KV-cache metrics are always on"),
    # ---- SchedulerConfig
    CompatFlag(("--enable-chunked-prefill",), SWITCH, "jaxserve always chunks long prefills "
               "(--max-num-batched-tokens bounds a step)", "jaxserve always chunks long "
               "prefills; raise --max-num-batched-tokens for larger steps",
               _is(True)),
    CompatFlag(("--max-num-partial-prefills",), VALUE, "one partial prefill at a time is "
               "jaxserve's policy", "jaxserve's scheduler runs one partial prefill at a time",
               _is("1")),
    CompatFlag(("--max-long-partial-prefills",), VALUE, "one partial prefill at a time is "
               "jaxserve's policy", "jaxserve's scheduler runs one partial prefill at a time",
               _is("1")),
    CompatFlag(("--long-prefill-token-threshold",), VALUE, "no threshold is asked for",
               "jaxserve's scheduler has no long-prefill threshold (--max-num-batched-tokens "
               "bounds each step)", _is("0")),
    CompatFlag(("--cuda-graph-sizes",), VALUES, _XLA),
    CompatFlag(("--disable-chunked-mm-input",), SWITCH, "there are no multimodal inputs"),
    CompatFlag(("--scheduler-cls",), VALUE, lacks="jaxserve has no pluggable scheduler "
               "classes (--scheduling-policy fcfs or priority)"),
    CompatFlag(("--stream-interval",), VALUE, "jaxserve streams every token as it is made",
               "jaxserve streams every token as it is made (no batching of stream chunks)",
               _is("1")),
    # ---- VllmConfig
    CompatFlag(("--kv-transfer-config",), VALUE, lacks="jaxserve has no disaggregated "
               "prefill or KV transfer"),
    CompatFlag(("--kv-events-config",), VALUE, lacks="jaxserve publishes no KV-cache events"),
    CompatFlag(("--compilation-config", "-O"), VALUE, _XLA),
    CompatFlag(("--additional-config",), VALUE, lacks="jaxserve takes no platform-specific "
               "additional config"),
    CompatFlag(("--structured-outputs-config",), VALUE, "jaxserve's structured outputs "
               "always use llguidance"),
    CompatFlag(("--guided-decoding-backend",), VALUE, "jaxserve's structured outputs always "
               "use llguidance"),
    # ---- Frontend
    CompatFlag(("--chat-template-content-format",), VALUE, "jaxserve detects the template's "
               "content format", "jaxserve renders message content as its chat template "
               "expects (auto) only", _is("auto")),
    CompatFlag(("--response-role",), VALUE, "answers have role assistant",
               "jaxserve's chat answers have role assistant only", _is("assistant")),
    CompatFlag(("--tool-parser-plugin",), VALUE, lacks="jaxserve loads no tool parser "
               "plugins (built-in parsers: --tool-call-parser)"),
    CompatFlag(("--tool-server",), VALUE, lacks="jaxserve runs no built-in tool servers"),
    CompatFlag(("--enable-prompt-tokens-details",), SWITCH, "jaxserve's usage always has "
               "prompt_tokens_details (cached tokens)"),
    CompatFlag(("--enable-server-load-tracking",), SWITCH, "load tracking stays off",
               "jaxserve has no /load route (its load is in /metrics: vllm:num_requests_"
               "running and vllm:num_requests_waiting)", _NOT_SWITCHED_ON),
    CompatFlag(("--enable-tokenizer-info-endpoint",), SWITCH, "the route stays off",
               "jaxserve has no /tokenizer_info route", _NOT_SWITCHED_ON),
    CompatFlag(("--tokens-only",), SWITCH, "every route is served",
               "jaxserve has no tokens-only mode", _NOT_SWITCHED_ON),
    CompatFlag(("--enable-per-request-metrics",), SWITCH, "the option stays off",
               "jaxserve puts no per-request timings in responses (see /metrics)",
               _NOT_SWITCHED_ON),
    CompatFlag(("--fingerprint-mode",), VALUE, "jaxserve's responses carry no "
               "system_fingerprint"),
    CompatFlag(("--fingerprint-value",), VALUE, "jaxserve's responses carry no "
               "system_fingerprint"),
    CompatFlag(("--middleware",), VALUES, lacks="jaxserve loads no ASGI middleware from import "
               "paths; put a proxy in front of it"),
    CompatFlag(("--enable-ssl-refresh",), SWITCH, "certificates load once",
               "jaxserve loads its TLS certificate at start-up only (restart to renew)",
               _NOT_SWITCHED_ON),
    CompatFlag(("--ssl-ciphers",), VALUE, lacks="jaxserve uses Python's default TLS cipher "
               "suites"),
    CompatFlag(("--h11-max-header-count",), VALUE, lacks="jaxserve bounds request headers by "
               "their size (--h11-max-incomplete-event-size), not their count"),
    CompatFlag(("--enable-offline-docs",), SWITCH, "jaxserve serves no documentation pages"),
    CompatFlag(("--disable-frontend-multiprocessing",), SWITCH, "the front end is one "
               "process; where the engine steps is --engine-process / --no-engine-process"),
    CompatFlag(("--data-parallel-supervisor-port",), VALUE, lacks=_HOSTS),
    CompatFlag(("--log-error-stack",), SWITCH, "jaxserve logs the traceback of every "
               "internal error (500)"),
    CompatFlag(("--disable-log-requests",), SWITCH, "per-request log lines are off unless "
               "--enable-log-requests"),
    CompatFlag(("--cohere-is-reasoning-model",), SWITCH, "jaxserve serves no Cohere API"),
    CompatFlag(("--cohere-format",), VALUE, "jaxserve serves no Cohere API"),
    CompatFlag(("--enable-flash-late-interaction",), SWITCH, "jaxserve has no late-interaction "
               "(ColBERT) scoring to speed up"),
    CompatFlag(("--uds",), VALUE, lacks="jaxserve listens on TCP (--host, --port) only"),
)


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """The flags above in a --help group of their own."""
    group = parser.add_argument_group(
        "vLLM flags without a jaxserve counterpart",
        "Accepted with a warning where they have no meaning here, refused with the reason "
        "where jaxserve lacks what they ask for.")
    for flag in FLAGS:
        if flag.kind == SWITCH:
            group.add_argument(*flag.flags, dest=flag.dest, default=None,
                               action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
        else:
            group.add_argument(*flag.flags, dest=flag.dest, default=None,
                               nargs="+" if flag.kind == VALUES else None,
                               help=argparse.SUPPRESS)
    group.description += " " + ", ".join(f.flags[0] for f in FLAGS) + "."


def check_compat(args: argparse.Namespace, warn: Callable[[str], None]) -> None:
    """warn(message) once for each given flag that is accepted; ValueError for the first
    one that is refused."""
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if flag.kind == VALUES:
            value = " ".join(value)
        shown = flag.flags[0] if flag.kind == SWITCH else f"{flag.flags[0]} {value}"
        if flag.kind == SWITCH and value is False:
            shown = "--no-" + flag.flags[0][2:]
        if flag.lacks is None or (flag.ignored is not None and flag.accepts(value)):
            warn(f"{shown}: ignored; {flag.ignored}.")
        else:
            raise ValueError(f"{shown}: {flag.lacks}.")
