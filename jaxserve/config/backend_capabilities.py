"""What each backend runs: one table, checked in one place (check_config, called by
EngineConfig; the multi-host CLI asks check_supported) and rendered into docs/usage.md
(capability_markdown; tests/config/test_backend_capabilities.py keeps the two equal).

Both backends run the same engine (scheduler, prefix caching, preemption, structured
outputs, the servers); they differ in the model families they have a model of (the family
table, models/__init__.py's FAMILIES), their attention implementations and the features of
FEATURES. A config using what its backend lacks is refused with the feature's message,
except where the feature has a fallback: then the backend does that instead.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.config.mesh import MeshShape
from jaxserve.models import FAMILIES, FAMILY_OF, resolve_architecture

# Which framework runs the model: JAX (every mesh) or PyTorch/Triton (one device).
BACKENDS = ("auto", "jax", "torch")
# The JAX backend's attention implementations (attend.py) and the torch backend's
# (backends/torch/attend.py); "auto" and "reference" exist on both.
JAX_ATTENTION_BACKENDS = ("auto", "pallas", "reference", "interpret", "interpret-gpu")
TORCH_ATTENTION_BACKENDS = ("auto", "reference", "triton", "triton-interpret")
ATTENTION_BACKENDS = tuple(dict.fromkeys(JAX_ATTENTION_BACKENDS + TORCH_ATTENTION_BACKENDS))


@dataclasses.dataclass(frozen=True)
class Feature:
    """Something a backend may lack. `refusal` is the ValueError's text on a backend without
    it, formatted with backend (the refusing one), supported (the names of the ones that
    have it, as messages write them: "JAX"), use ("backend='jax'") and config (the
    EngineConfig being checked)."""

    name: str  # the key of BackendCapabilities.features
    label: str  # its row in the docs' table
    # (EngineConfig) -> whether the config uses it; None: not an EngineConfig's setting
    # (multi_host: the CLI's flags), or not refused (a fallback)
    used: Callable | None = None
    refusal: str = "{label} runs on the {supported} backend only; use {use}."
    fallback: str = ""  # not refused: what a backend without it does instead


FEATURES = (
    Feature("mesh", "tensor, data and expert parallelism (`mesh`, `tensor_parallel_size`, "
            "`data_parallel_size`)",
            used=lambda config: config.parallel.mesh != MeshShape(),
            refusal="The {backend} backend runs on one device; got mesh {config.parallel.mesh}. "
                    "Use the {supported} backend for tensor, data and expert parallelism "
                    "(tensor parallelism for the {backend} backend is later work)."),
    Feature("multi_host", "multi-host serving (`--coordinator`, `--multi-host`)",
            refusal="Multi-host serving runs the {supported} backend; the {backend} backend "
                    "runs on one device. Drop --backend {backend} or the multi-host flags."),
    Feature("lora", "LoRA adapters (`enable_lora`)",
            used=lambda config: config.lora is not None,
            refusal="enable_lora: LoRA adapters run on the {supported} backend only; drop "
                    "enable_lora or use {use}."),
    Feature("sleep_mode", "sleep mode (`enable_sleep_mode`)",
            used=lambda config: config.enable_sleep_mode,
            refusal="enable_sleep_mode: sleep and wake_up run on the {supported} backend "
                    "only; drop enable_sleep_mode or use {use}."),
    Feature("int8_weights", "int8 weights quantized while loading (`quantization=\"int8\"`)",
            used=lambda config: config.model.weights_scheme == "int8",
            refusal="quantization: int8 weights run on the {supported} backend only; drop "
                    "quantization or use {use}."),
    Feature("speculative", "n-gram speculative decoding (`speculative_config`)",
            used=lambda config: config.speculative is not None,
            refusal="speculative_config: speculative decoding runs on the {supported} "
                    "backend only; drop speculative_config or use {use}."),
    Feature("orbax", "Orbax checkpoints (`jaxserve convert`)",
            used=lambda config: config.model.is_orbax,
            refusal="{config.model.model} is an Orbax checkpoint (jaxserve convert), which "
                    "the {supported} backend restores; the {backend} backend loads Hugging "
                    "Face folders. Use {use} or the original folder."),
    Feature("shared_kv_slots", "window and full-attention layers in KV groups of their own "
            "(`hybrid_kv_cache`)",
            fallback="one KV group: every layer holds the whole sequence"),
)
FEATURE = {feature.name: feature for feature in FEATURES}


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """One backend's row: its attention implementations and the FEATURES it has (its model
    families come from the family table)."""

    name: str  # EngineConfig.backend
    label: str  # what messages call it
    attention_backends: tuple[str, ...]  # attention_backend's values it takes
    features: frozenset[str]  # the FEATURES it has


CAPABILITIES = {
    "jax": BackendCapabilities("jax", "JAX", JAX_ATTENTION_BACKENDS, frozenset(FEATURE)),
    "torch": BackendCapabilities("torch", "torch", TORCH_ATTENTION_BACKENDS, frozenset()),
}


def resolve_backend(backend: str) -> str:
    """auto -> jax (the torch backend is chosen, never picked for the user)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}.")
    return "jax" if backend == "auto" else backend


def supports(backend: str, feature: str) -> bool:
    """Whether `backend` ("auto", "jax" or "torch") has FEATURES' `feature`."""
    return feature in CAPABILITIES[resolve_backend(backend)].features


def check_supported(backend: str, feature: str, config=None) -> None:
    """ValueError with the feature's refusal unless `backend` has it (config: the
    EngineConfig the message may name values of)."""
    if supports(backend, feature):
        return
    backend = resolve_backend(backend)
    having = [b for b in CAPABILITIES.values() if feature in b.features]
    raise ValueError(FEATURE[feature].refusal.format(
        label=FEATURE[feature].label, backend=backend, config=config,
        supported=" or ".join(b.label for b in having),
        use=" or ".join(f"backend={b.name!r}" for b in having)))


def check_family(backend: str, hf_config: dict) -> None:
    """ValueError naming the family and the backend when the backend has no model of the
    config's family (the family table: models/__init__.py)."""
    architecture = resolve_architecture(hf_config)
    family = FAMILY_OF[architecture]
    if family.model_path(backend) is not None:
        return
    having = [b for b in CAPABILITIES.values() if family.model_path(b.name) is not None]
    gap = family.torch_gap or f"the {backend} backend has no {family.label} model"
    raise ValueError(f"{family.label} ({architecture}) runs on the "
                     f"{' or '.join(b.label for b in having)} backend only: {gap}. Use "
                     f"{' or '.join(f'backend={b.name!r}' for b in having)}.")


def check_attention_backend(backend: str, attention: str) -> None:
    """The attention implementation exists on the backend."""
    own = CAPABILITIES[backend].attention_backends
    if attention not in own:
        other = next(b.name for b in CAPABILITIES.values() if attention in b.attention_backends)
        raise ValueError(f"attention_backend={attention!r} belongs to the {other} backend; "
                         f"the {backend} backend takes {', '.join(own)}.")


def check_config(config) -> None:
    """What an EngineConfig being built uses that its backend lacks, in one place: the
    model's family, the attention implementation, then FEATURES in order."""
    if config.backend not in CAPABILITIES:
        raise ValueError(f"backend must be jax or torch once resolved, got {config.backend!r}.")
    check_family(config.backend, config.model.hf_config)
    check_attention_backend(config.backend, config.attention.backend)
    for feature in FEATURES:
        if feature.used is not None and feature.used(config):
            check_supported(config.backend, feature.name, config)


def _cell(backend: BackendCapabilities, feature: Feature) -> str:
    if feature.name in backend.features:
        return "yes"
    return f"no ({feature.fallback})" if feature.fallback else "no"


def capability_markdown() -> str:
    """The table as docs/usage.md shows it: a row per family list, attention and feature."""
    backends = list(CAPABILITIES.values())
    rows = [["feature", *(f"`{b.name}`" for b in backends)], ["---"] * (len(backends) + 1)]
    rows.append(["model families (`models/__init__.py`)",
                 *(", ".join(f.label for f in FAMILIES if f.model_path(b.name) is not None)
                   for b in backends)])
    rows.append(["attention (`attention_backend`)",
                 *(", ".join(f"`{name}`" for name in b.attention_backends) for b in backends)])
    rows += [[feature.label, *(_cell(b, feature) for b in backends)] for feature in FEATURES]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n"
