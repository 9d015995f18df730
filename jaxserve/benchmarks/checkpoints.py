"""The checkpoints the tests and benchmarks run on, written on demand: tiny, deterministic
random-weight Hugging Face checkpoints of every architecture (the tests'; made by
scripts/make_tiny_checkpoint.py and tests/conftest.py), and the "small" benchmark Llama
(~125M parameters; scripts/make_small_checkpoint.py, `ensure_small_checkpoint`).

Each is a real `transformers` model (float32, one model.safetensors) with a byte-level BPE
tokenizer trained offline on Python standard-library sources, so nothing is downloaded.
In the tiny ones every parameter is drawn at random, biases and norm weights included, so a
dropped bias or a wrong norm shows up; the small one keeps transformers' own initialisation
(std 0.02): it exists to measure speed, not quality.
"""

from __future__ import annotations

import contextlib
import functools
import math
import pathlib
import sys
import sysconfig
import tempfile
import zlib

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
         "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v2")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # ids 0..4, in this order
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(5)
VOCAB_SIZE = 1024
CORPUS_BYTES = 2_000_000  # of stdlib sources: trains in a few seconds
STDLIB = pathlib.Path(sysconfig.get_paths()["stdlib"])

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_IDS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    hidden_act="silu",
    **SPECIAL_IDS,
)

ARCH_CONFIGS = {
    "llama": dict(
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        sliding_window=96,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen2": dict(  # Qwen2Config has no head_dim field: hidden_size // heads = 16
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3": dict(
        head_dim=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # MoE: 8 experts, 8 query and 2 kv heads and widths divisible by 8, so that 1, 2, 4 and 8
    # devices can shard experts and heads.
    "mixtral": dict(
        num_attention_heads=8,
        head_dim=16,
        intermediate_size=64,  # per expert
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen2_moe": dict(  # layer 1 dense (mlp_only_layers); a gated shared expert; qkv bias
        num_hidden_layers=3,
        num_attention_heads=8,
        head_dim=16,
        intermediate_size=128,  # dense layers
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_moe": dict(  # top-3 of 8, renormalised; q/k norms
        num_attention_heads=8,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # Gemma: windows of 48 (the longer prompts reach past them), tied embeddings as
    # published; Gemma 2's attention cap low enough that tanh bends the larger logits
    # (lower caps made the tiny model repeat itself).
    "gemma2": dict(  # sliding, full, sliding, full
        num_hidden_layers=4,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=30.0,
        sliding_window=48,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gemma3": dict(  # five sliding layers (RoPE base 1e4), one full (1e6, linear x8)
        num_hidden_layers=6,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=16,
        sliding_window=48,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # GPT-OSS: sinks, q/k/v/o biases, sliding (48) and full layers alternating, YaRN from 64
    # positions (the longer prompts pass it); top-2 of 8 biased experts of 64, whose widths
    # are multiples of 32 so a test can store them in MXFP4.
    "gpt_oss": dict(
        num_attention_heads=8,
        head_dim=16,
        intermediate_size=64,  # per expert
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=48,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0},
    ),
    # DeepSeek-V3: MLA with the query LoRA, interleaved RoPE with YaRN from 64 positions whose
    # mscale and mscale_all_dim differ (cos/sin and the softmax scale both change); layer 0
    # dense, then top-2 of 8 experts in 4 groups (2 kept) by sigmoid scores with the
    # correction bias, renormalised and scaled by 2.5, and one shared expert.
    "deepseek_v3": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    ),
    # DeepSeek-V2-Lite's shape: no query LoRA, softmax routing (greedy top-2 of 8, not
    # renormalised), two shared experts, layer 0 dense, YaRN with equal mscales.
    "deepseek_v2": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        moe_intermediate_size=32,
        num_experts_per_tok=2,
        topk_method="greedy",
        first_k_dense_replace=1,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    ),
}

# Weight scales, as multiples of 1/sqrt(fan_in): large enough that attention is
# far from uniform and greedy decoding has clear top-1/top-2 gaps.
EMBED_STD = 0.3  # tied qwen2: larger makes the input token its own argmax
# Gemma multiplies the embeddings by sqrt(hidden) = 8: the same scale after that.
EMBED_STD_OF = {"gemma2": EMBED_STD / 8, "gemma3": EMBED_STD / 8}
PROJ_GAIN = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 1.5, "o_proj": 1.0,
             "gate_proj": 1.5, "up_proj": 1.5, "down_proj": 1.0,
             "gate_up_proj": 1.5, "gate": 2.0, "shared_expert_gate": 1.0,  # MoE: fused experts
             "router": 2.0, "q_a_proj": 1.5, "q_b_proj": 2.0, "kv_a_proj_with_mqa": 2.0,
             "kv_b_proj": 2.0}
# [E, out, in] (transformers 5 in memory; GPT-OSS's [E, in, out]), router ("gate", GPT-OSS's
# "router") and Qwen2-MoE's shared-expert gate
SINK_STD = 1.5  # GPT-OSS's attention sinks: logits beside scores of a few units
LM_HEAD_GAIN = 4.0
BIAS_STD = 0.5
NORM_RANGE = (0.5, 1.5)

# Random logits leave a near-tie somewhere in a few hundred greedy steps whatever
# the std (P(top-2 gap < 1e-3 * max|logit|) is ~1% per step). So the per-arch
# offset added to --seed was picked by trying offsets until, with seed 0, every
# step of greedy_margins(check_prompts()) has a gap above 1.7e-3 * max|logit|.
SEED_OFFSET = {"llama": 193, "mistral": 273, "qwen2": 250, "qwen3": 735,
               "mixtral": 695, "qwen2_moe": 5, "qwen3_moe": 12, "gemma2": 91, "gemma3": 80,
               "gpt_oss": 50, "deepseek_v3": 48, "deepseek_v2": 36}
# The smallest top-2 gap (of max |logit|) the margin test accepts: 1.5e-3, and for Gemma,
# whose tiny models have flatter logits (tied embeddings, Gemma 2's final soft cap), a floor
# just below the best of 150-250 offsets tried (1.52e-3 and 1.09e-3), and for DeepSeek
# (MoE routing over 8 experts in few dimensions) the best of 60 (1.09e-3 V3, 1.27e-3 V2):
# still ~100x the float32 difference between jaxserve and HF on them (about 1e-5 of max
# |logit|).
MIN_REL_GAP = {"gemma2": 1.4e-3, "gemma3": 1.0e-3, "gpt_oss": 1.0e-3, "deepseek_v3": 1.0e-3,
               "deepseek_v2": 1.2e-3}


def _corpus_files() -> list[pathlib.Path]:
    """The first stdlib modules (top level, by name) up to CORPUS_BYTES."""
    files, total = [], 0
    for path in sorted(STDLIB.glob("*.py")):
        if total >= CORPUS_BYTES:
            break
        files.append(path)
        total += path.stat().st_size
    return files


def train_tokenizer(out_dir, files=None, vocab_size: int = VOCAB_SIZE) -> None:
    """Train the byte-level BPE (on `files`, default a fixed stdlib subset) and save it as a
    PreTrainedTokenizerFast in out_dir. The special tokens take ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (p.read_text(encoding="utf-8", errors="replace")
             for p in (files if files is not None else _corpus_files()))
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, want {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    # Like Llama 3: prepend bos when add_special_tokens=True.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, BOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=COMMON["max_position_embeddings"],
    )
    fast.save_pretrained(str(out_dir))


@functools.lru_cache(maxsize=1)
def _tokenizer_files() -> tuple[tuple[str, bytes], ...]:
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(tmp)
        return tuple((p.name, p.read_bytes()) for p in sorted(pathlib.Path(tmp).iterdir()))


# For the mesh tests: 8 query heads (and the same 2 kv heads), so that model axes of 1, 2, 4
# and 8 devices split the heads and 4 and 8 replicate the kv heads. Greedy tokens are
# compared across meshes, not with HF, so no seed search is needed for margins.
MESH_OVERRIDES = {"num_attention_heads": 8}


def make_config(arch: str, overrides: dict | None = None):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "gemma2": transformers.Gemma2Config,
           "gemma3": transformers.Gemma3TextConfig, "gpt_oss": transformers.GptOssConfig,
           "deepseek_v3": transformers.DeepseekV3Config,
           "deepseek_v2": transformers.DeepseekV2Config}[arch]
    return cls(**{**COMMON, **ARCH_CONFIGS[arch], **(overrides or {})}, dtype="float32")


def _randomize(model, arch: str, seed: int) -> None:
    """Overwrite every parameter, in state_dict order, from a (seed, arch) generator."""
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{arch}:{seed + SEED_OFFSET[arch]}".encode()))
    seen = set()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.data_ptr() in seen:  # tied lm_head: drawn once, as the embedding
                continue
            seen.add(t.data_ptr())
            if name.endswith("norm.weight"):
                lo, hi = NORM_RANGE
                t.copy_(torch.rand(t.shape, generator=gen) * (hi - lo) + lo)
            elif name.endswith((".bias", "_bias")):  # GPT-OSS's experts: *_proj_bias
                t.copy_(torch.randn(t.shape, generator=gen) * BIAS_STD)
            elif name.endswith(".sinks"):
                t.copy_(torch.randn(t.shape, generator=gen) * SINK_STD)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * EMBED_STD_OF.get(arch, EMBED_STD))
            elif name.endswith("lm_head.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * LM_HEAD_GAIN / math.sqrt(t.shape[1]))
            else:  # a [out, in] or [E, out, in] weight
                parts = name.split(".")
                gain = PROJ_GAIN[parts[-2] if parts[-1] == "weight" else parts[-1]]
                t.copy_(torch.randn(t.shape, generator=gen) * gain / math.sqrt(t.shape[-1]))
    for name, t in model.state_dict().items():
        if t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            raise RuntimeError(f"{arch}: parameter {name} is still constant")


@contextlib.contextmanager
def torch_threads(n: int):
    """Run torch on n threads, then restore. One thread: on the 2-core dev VMs a
    second thread made these tiny matmuls ~50x slower (wake-up latency)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_checkpoint(arch: str, out_dir, seed: int = 0,
                    overrides: dict | None = None) -> pathlib.Path:
    """Write the `arch` checkpoint (weights, config, tokenizer) into out_dir; overrides
    change config values (e.g. MESH_OVERRIDES)."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    transformers.utils.logging.disable_progress_bar()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch_threads(1):
        model = transformers.AutoModelForCausalLM.from_config(make_config(arch, overrides),
                                                              dtype=torch.float32)
        _randomize(model, arch, seed)
    _save_model(model, out, eos_token_id=[EOS_ID, IM_END_ID])
    for name, data in _tokenizer_files():
        (out / name).write_bytes(data)
    return out


def _save_model(model, out: pathlib.Path, eos_token_id) -> None:
    import transformers

    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=eos_token_id, pad_token_id=PAD_ID)
    model.save_pretrained(str(out), safe_serialization=True)


# ---------------------------------------------------------------- the small benchmark Llama

# hidden 768, 12 layers, 12 heads, 4 kv heads, intermediate 2048, vocab 32000, untied
# lm_head; its tokenizer: the tiny ones' recipe, 32,000 tokens over the whole stdlib.
SMALL_CONFIG = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    **SPECIAL_IDS,
)
SMALL_DIR = pathlib.Path.home() / ".cache" / "jaxserve-bench" / "small-llama-125m"


def _stdlib_files() -> list[pathlib.Path]:
    """All standard-library sources (~30 MB): enough text for 32,000 BPE merges."""
    return sorted(p for p in STDLIB.rglob("*.py") if "site-packages" not in p.parts)


def make_small_checkpoint(out_dir) -> pathlib.Path:
    import torch
    import transformers

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMALL_CONFIG, dtype="float32")
    model = transformers.LlamaForCausalLM(config).eval()
    params = sum(p.numel() for p in model.parameters())
    _save_model(model, out, eos_token_id=EOS_ID)
    train_tokenizer(out, _stdlib_files(), vocab_size=SMALL_CONFIG["vocab_size"])
    print(f"wrote {out}: {params / 1e6:.1f}M parameters", file=sys.stderr)
    return out


def ensure_small_checkpoint(out_dir=SMALL_DIR) -> pathlib.Path:
    """The checkpoint in out_dir, made first if it is not there yet."""
    out = pathlib.Path(out_dir)
    if not (out / "model.safetensors").is_file() or not (out / "tokenizer.json").is_file():
        make_small_checkpoint(out)
    return out
