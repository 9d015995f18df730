"""Gemma 2 and Gemma 3 (text): architecture settings and checkpoint layout, both backends.

What differs from Llama (llama_arch.py), as HF's Gemma2/Gemma3 models compute it:
- RMSNorm scales by (1 + weight), in float32 before the cast back;
- four norms per layer: input_norm before attention, post_attention_norm on its output,
  pre_feedforward_norm before the MLP, post_feedforward_norm on its output;
- GeGLU: gelu (tanh approximation) on the gate;
- the embeddings times sqrt(hidden_size), rounded to the model's dtype;
- queries scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- Gemma 2: tanh soft-capping of the attention logits (attn_logit_softcapping) and of the
  final logits (final_logit_softcapping);
- sliding-window layers by `layer_types` (Gemma 2: every other layer, the first sliding;
  Gemma 3: five sliding to one full);
- Gemma 3: q/k RMSNorm per head, the sliding layers' own RoPE (`rope_local_base_freq`, no
  scaling) and the full layers' (rope_theta, with rope_scaling: linear on the 4B..27B).

Parameter paths are Llama's where the tensor is the same (wq [D, N, H], mlp.w_gate, ...), so
the mesh's partition rules and the int8 scheme apply unchanged. numpy only.
"""

from __future__ import annotations

import dataclasses

from jaxserve.models import llama_arch
from jaxserve.models.llama_arch import LlamaArch, attention_shapes, mlp_shapes

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MULTIMODAL = "Gemma3ForConditionalGeneration"  # the 4B, 12B and 27B as published
# transformers' Gemma3TextConfig defaults: a published multimodal config.json gives only the
# text settings that differ from them.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, attention_bias=False,
    final_logit_softcapping=None, attn_logit_softcapping=None)
# Tensors of a multimodal folder that the text model does not read (skipped at load).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def language_model_config(hf: dict) -> dict:
    """A Gemma3ForConditionalGeneration config as its language model's: the text_config over
    transformers' defaults, with the folder's dtype, tied embeddings and EOS ids, still named
    by the multimodal architecture (whose weights carry a `language_model.` prefix). Any
    other config is returned as it is."""
    if (hf.get("architectures") or [""])[0] != MULTIMODAL:
        return hf
    text = dict(hf.get("text_config") or {})
    flat = {**GEMMA3_TEXT_DEFAULTS, **text, "architectures": [MULTIMODAL],
            "model_type": "gemma3_text"}
    for key in ("dtype", "torch_dtype", "tie_word_embeddings", "eos_token_id"):
        if key in hf:
            flat[key] = hf[key]
    return flat


@dataclasses.dataclass(frozen=True)
class GemmaArch(LlamaArch):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the sliding layers' RoPE as sorted (key, value) pairs with rope_theta among
    # them (None: every layer uses rope_theta / rope_scaling).
    local_rope: tuple | None = None
    multimodal: bool = False  # a Gemma3ForConditionalGeneration folder: its language model

    @classmethod
    def from_hf(cls, hf: dict) -> GemmaArch:
        arch = (hf.get("architectures") or [""])[0]
        if arch == MULTIMODAL and "text_config" in hf:
            hf = language_model_config(hf)
        if arch not in GEMMA_ARCHITECTURES + (MULTIMODAL,):
            raise ValueError(f"not a Gemma 2/3 config: {arch!r}")
        gemma3 = arch != "Gemma2ForCausalLM"
        num_layers = int(hf["num_hidden_layers"])
        full, local = _rope_parameters(hf, gemma3)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma; "
                             "jaxserve supports gelu_pytorch_tanh.")
        base = LlamaArch.from_hf({**hf, "rope_parameters": full,
                                  "architectures": ["LlamaForCausalLM"]})
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArch)}
        fields.update(
            attention_bias=bool(hf.get("attention_bias", False)), qk_norm=gemma3,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            sliding_windows=_sliding_windows(hf, num_layers, gemma3))
        cap = hf.get("attn_logit_softcapping")
        final = hf.get("final_logit_softcapping")
        local_rope = None
        if local is not None:
            local_rope = tuple(sorted((k, v) for k, v in local.items()
                                      if not isinstance(v, list)))
        return cls(**fields, query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                   attn_logit_softcapping=None if cap is None else float(cap),
                   final_logit_softcapping=None if final is None else float(final),
                   local_rope=local_rope, multimodal=arch == MULTIMODAL)

    @property
    def embed_scale(self) -> float:
        return self.hidden_size ** 0.5

    def layer_rope(self, layer: int) -> LlamaArch:
        """The settings rope_inv_freq reads for one layer (Gemma 3's sliding layers have
        their own base)."""
        if self.local_rope is None or self.sliding_windows[layer] is None:
            return self
        params = dict(self.local_rope)
        theta = float(params.pop("rope_theta"))
        return dataclasses.replace(self, rope_theta=theta,
                                   rope_scaling=tuple(sorted(params.items())))


def _rope_parameters(hf: dict, gemma3: bool) -> tuple[dict, dict | None]:
    """(the full layers' RoPE parameters, the sliding layers' or None), each with its
    rope_theta. transformers 5 writes Gemma 3's as one dict per layer type; published
    configs as rope_theta, rope_scaling and rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = params.get("sliding_attention")
        return full, (dict(local) if gemma3 and local else None)
    full = dict(params or hf.get("rope_scaling") or {"rope_type": "default"})
    full.setdefault("rope_theta", float(hf.get("rope_theta", 10000.0)))
    if not gemma3:
        return full, None
    local = {"rope_type": "default",
             "rope_theta": float(hf.get("rope_local_base_freq", 10000.0))}
    return full, local


def _sliding_windows(hf: dict, num_layers: int, gemma3: bool) -> tuple:
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if not types:  # the published configs before layer_types
        if gemma3:
            pattern = int(hf.get("sliding_window_pattern", 6))
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(num_layers)]
        else:
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                     for i in range(num_layers)]
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers.")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def hf_param_path(name: str, arch: GemmaArch):
    """HF tensor name -> (parameter path, transform), None to skip; KeyError if unknown. A
    multimodal folder's language model is under `language_model.` (as published) or
    `model.language_model.` (transformers 5 in memory); its vision parts are skipped."""
    if arch.multimodal:
        if name.startswith(VISION_PREFIXES):
            return None
        for prefix in ("language_model.model.", "model.language_model."):
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        else:
            name = name.removeprefix("language_model.")  # its lm_head, when not tied
            if not name.startswith("lm_head."):
                raise KeyError(name)
    parts = name.removeprefix("model.").split(".")
    if parts[0] == "layers":
        rest = ".".join(parts[2:])
        norms = {"post_attention_layernorm.weight": "post_attention_norm",
                 "pre_feedforward_layernorm.weight": "pre_feedforward_norm",
                 "post_feedforward_layernorm.weight": "post_feedforward_norm"}
        if rest in norms:
            return ("layers", int(parts[1]), norms[rest], "weight"), None
    return llama_arch.hf_param_path(name, arch)


def param_shapes(arch: GemmaArch, quantization: str | None = None) -> dict:
    """Every parameter, {path: (shape, dtype or None)} (see llama_arch.param_shapes)."""
    d = arch.hidden_size
    shapes = {("embed",): ((arch.vocab_size, d), None)}
    for i in range(arch.num_layers):
        layer = ("layers", i)
        for norm in ("input_norm", "post_attention_norm", "pre_feedforward_norm",
                     "post_feedforward_norm"):
            shapes[layer + (norm, "weight")] = ((d,), None)
        shapes.update(attention_shapes(layer + ("attn",), arch, quantization))
        shapes.update(mlp_shapes(layer + ("mlp",), d, arch.intermediate_size, quantization))
    shapes[("norm", "weight")] = ((d,), None)
    if not arch.tie_word_embeddings:
        shapes[("lm_head",)] = ((arch.vocab_size, d), None)
    return shapes
