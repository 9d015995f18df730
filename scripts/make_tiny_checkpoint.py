"""Write tiny, deterministic random-weight Hugging Face checkpoints for tests.

Each checkpoint is a real `transformers` model (float32, one model.safetensors)
with a byte-level BPE tokenizer trained offline on Python standard-library
sources, so parity tests need no download. Every parameter is drawn at random,
biases and norm weights included, so a dropped bias or a wrong norm shows up.

    python scripts/make_tiny_checkpoint.py --arch llama --out DIR [--seed 0]
    python scripts/make_tiny_checkpoint.py --arch all --out DIR   # DIR/<arch>
    python scripts/make_tiny_checkpoint.py --arch all --out DIR --check
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import pathlib
import sys
import sysconfig
import tempfile
import time
import zlib

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # ids 0..4, in this order
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(5)
VOCAB_SIZE = 1024
CORPUS_BYTES = 2_000_000  # of stdlib sources: trains in a few seconds

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    hidden_act="silu",
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
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
}

# Weight scales, as multiples of 1/sqrt(fan_in): large enough that attention is
# far from uniform and greedy decoding has clear top-1/top-2 gaps.
EMBED_STD = 0.3  # tied qwen2: larger makes the input token its own argmax
PROJ_GAIN = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": 1.5, "o_proj": 1.0,
             "gate_proj": 1.5, "up_proj": 1.5, "down_proj": 1.0,
             "gate_up_proj": 1.5, "gate": 2.0, "shared_expert_gate": 1.0}  # MoE: fused experts
# [E, out, in] (transformers 5 in memory), router ("gate") and Qwen2-MoE's shared-expert gate
LM_HEAD_GAIN = 4.0
BIAS_STD = 0.5
NORM_RANGE = (0.5, 1.5)

# Random logits leave a near-tie somewhere in a few hundred greedy steps whatever
# the std (P(top-2 gap < 1e-3 * max|logit|) is ~1% per step). So the per-arch
# offset added to --seed was picked by trying offsets until, with seed 0, every
# step of greedy_margins(check_prompts()) has a gap above 1.7e-3 * max|logit|.
SEED_OFFSET = {"llama": 193, "mistral": 273, "qwen2": 250, "qwen3": 735,
               "mixtral": 695, "qwen2_moe": 5, "qwen3_moe": 12}


def _corpus_files() -> list[pathlib.Path]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
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
           "qwen3_moe": transformers.Qwen3MoeConfig}[arch]
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
            elif name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * BIAS_STD)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn(t.shape, generator=gen) * EMBED_STD)
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
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    for name, data in _tokenizer_files():
        (out / name).write_bytes(data)
    return out


# ---------------------------------------------------------------- --check

def check_prompts() -> list[list[int]]:
    """Eight fixed prompts of 3..200 token ids (bos first), independent of the tokenizer."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    lengths = (3, 7, 16, 33, 60, 97, 150, 200)
    return [[BOS_ID] + torch.randint(len(SPECIAL_TOKENS), VOCAB_SIZE, (n - 1,), generator=gen).tolist()
            for n in lengths]


def _load(ckpt):
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not isinstance(ckpt, (str, pathlib.Path)):
        return ckpt  # already a model
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def greedy_margins(ckpt, prompts, new_tokens: int = 40) -> list[dict]:
    """HF greedy generate (eos suppressed by min_new_tokens) on each prompt.

    Per prompt: the generated `tokens`, the smallest top-1 minus top-2 logit `gap`
    over the steps, and the smallest such gap divided by that step's max |logit|
    (`rel_gap`); `max_logit` is the largest |logit| seen.
    """
    import torch

    model = _load(ckpt)
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                output_scores=True, return_dict_in_generate=True,
            )
        scores = torch.cat(out.scores)  # f32[steps, V]; eos ids are -inf
        top2 = scores.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        peak = scores.masked_fill(~torch.isfinite(scores), 0).abs().amax(-1)
        results.append(dict(tokens=out.sequences[0, len(prompt):].tolist(),
                            gap=float(gaps.min()), rel_gap=float((gaps / peak).min()),
                            max_logit=float(peak.max())))
    return results


def cache_consistency(ckpt, prompt, new_tokens: int = 40) -> bool:
    """Greedy tokens of generate (with cache) equal those of repeated full forwards."""
    import torch

    model = _load(ckpt)
    with torch.no_grad():
        cached = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens)[0, len(prompt):].tolist()
        seq = list(prompt)
        for _ in range(new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            logits[[EOS_ID, IM_END_ID]] = -math.inf
            seq.append(int(logits.argmax()))
    return cached == seq[len(prompt):]


def run_check(root: pathlib.Path, archs) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(root / archs[0]))
    text = "héllo wörld — 你好, мир! 🙂 def f(x):\n\treturn x ** 2  # ok"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok(text)["input_ids"][0] == BOS_ID
    text = pathlib.Path(__file__).read_text(encoding="utf-8")[:3000]
    long_prompt = [BOS_ID] + tok(text, add_special_tokens=False)["input_ids"][:219]
    for arch in archs:
        model = _load(root / arch)
        res = greedy_margins(model, check_prompts())
        print(f"{arch:8s} min gap {min(r['gap'] for r in res):.4f}  "
              f"min relative gap {min(r['rel_gap'] for r in res):.2e}  "
              f"max|logit| {max(r['max_logit'] for r in res):.1f}  "
              f"distinct tokens/40 {min(len(set(r['tokens'])) for r in res)}.."
              f"{max(len(set(r['tokens'])) for r in res)}")
        print("         per-prompt min gaps: " + " ".join(f"{r['gap']:.3f}" for r in res))
        ok = all(cache_consistency(model, p) for p in (long_prompt[:180], long_prompt))
        print(f"         generate(cache) == full forwards on 180+40 and 220+40 tokens: {ok}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", required=True, choices=(*ARCHS, "all"))
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true",
                        help="also report greedy top1-top2 logit gaps and cache consistency")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # see torch_threads
    t0 = time.perf_counter()
    if args.arch == "all":
        archs = ARCHS
        for arch in archs:
            make_checkpoint(arch, args.out / arch, args.seed)
        root = args.out
    else:
        archs = (args.arch,)
        make_checkpoint(args.arch, args.out, args.seed)
        root = args.out.parent
        if args.out.name != args.arch and args.check:
            sys.exit("--check with one arch needs --out ending in the arch name")
    print(f"wrote {', '.join(archs)} to {args.out} in {time.perf_counter() - t0:.1f} s")
    if args.check:
        run_check(root, archs)


if __name__ == "__main__":
    main()
