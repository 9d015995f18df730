"""Train jaxserve's built-in default model on the Python standard library.

    python scripts/train_default_model.py --out jaxserve/default_model [--minutes 40]

A Llama-architecture model of a few million parameters, defined by the same
models/jax/llama.py the engine serves, with a byte-level BPE tokenizer (4096 tokens). It trains
with optax AdamW on the standard library's .py sources; the files of a few packages
(HELD_OUT) are never seen and give the held-out perplexity. Deterministic for a seed and a
step count (--steps; --minutes only stops early and says so). Runs on 2 CPU cores; prints
the loss and held-out perplexity as it goes; writes a Hugging Face folder (config.json,
model.safetensors in bfloat16, tokenizer files, chat template, model card).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import shutil
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxserve.backends.jax.batch import Batch
from jaxserve.models.jax.llama import LlamaArch, LlamaForCausalLM, hf_param_path

HELD_OUT = ("email", "json", "xmlrpc", "wsgiref")  # packages never trained on
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
VOCAB = 4096
CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu", attention_bias=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=4, dtype="bfloat16",
)


def load_tiny_script():
    path = pathlib.Path(__file__).with_name("make_tiny_checkpoint.py")
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def split_files() -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for path in sorted(stdlib.rglob("*.py")):
        parts = path.relative_to(stdlib).parts
        if SKIP_PARTS & set(parts):
            continue
        (held if parts[0] in HELD_OUT else train).append(path)
    return train, held


def encode(tokenizer, files) -> np.ndarray:
    """All files as one token stream, each file as bos + text + eos."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return np.concatenate([np.asarray(x + [eos], np.int32) for x in ids])


def dense_causal_attention(q, k_cache, v_cache, batch, *, scale, sliding_window=None):
    """Training attention: batch.num_seqs sequences of equal length laid out contiguously
    in the cache (slot = token index), so the cache is the dense K/V. q: [T, N, H]."""
    num_seqs = batch.kv_lens.shape[0]
    t, n, h = q.shape
    length = t // num_seqs
    kv = k_cache.shape[2]
    qg = q.reshape(num_seqs, length, kv, n // kv, h)
    k = k_cache.reshape(num_seqs, length, kv, h)
    v = v_cache.reshape(num_seqs, length, kv, h)
    s = jnp.einsum("blkgh,bmkh->bkglm", qg, k).astype(jnp.float32) * scale
    causal = jnp.tril(jnp.ones((length, length), bool))
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1).astype(q.dtype)
    return jnp.einsum("bkglm,bmkh->blkgh", p, v).reshape(t, n, h)


def training_batch(num_seqs: int, length: int, block: int) -> Batch:
    tokens = num_seqs * length
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), num_seqs)
    return Batch(token_ids=jnp.zeros(tokens, jnp.int32), positions=positions,
                 slot_mapping=jnp.arange(tokens, dtype=jnp.int32),
                 cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * length,
                 kv_lens=jnp.full(num_seqs, length, jnp.int32),
                 block_tables=jnp.arange(tokens // block, dtype=jnp.int32).reshape(num_seqs, -1),
                 num_seqs=jnp.array([num_seqs], jnp.int32),
                 logits_indices=jnp.zeros(num_seqs, jnp.int32))


def init_params(arch: LlamaArch, seed: int):
    model = LlamaForCausalLM(arch, jnp.float32)
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(seed), 256))
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if path[-1] == "weight":  # RMSNorm scales
            new = jnp.ones_like(value)
        else:
            std = 0.02 / (math.sqrt(2 * arch.num_layers) if path[-1] in ("wo", "w_down") else 1)
            new = std * jax.random.normal(next(keys), value.shape, jnp.float32)
        flat.append((path, var.replace(new)))
    return graphdef, nnx.from_flat_state(flat)


def make_loss(graphdef, arch: LlamaArch, num_seqs: int, length: int):
    block = 16
    batch0 = training_batch(num_seqs, length, block)
    cache_shape = (num_seqs * length // block, block, arch.num_kv_heads, arch.head_dim)

    def loss_fn(params, tokens):  # tokens: i32[num_seqs, length + 1]
        model = nnx.merge(graphdef, params)
        inputs = tokens[:, :-1].reshape(-1)
        batch = Batch(**{**batch0.__dict__, "token_ids": inputs})
        caches = [(jnp.zeros(cache_shape), jnp.zeros(cache_shape))
                  for _ in range(arch.num_layers)]
        _, hidden = model(caches, batch, dense_causal_attention)
        logits = model.logits(hidden)
        targets = tokens[:, 1:].reshape(-1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


def sample_batches(stream: np.ndarray, num_seqs: int, length: int, rng: np.random.Generator):
    starts = rng.integers(0, len(stream) - length - 1, size=num_seqs)
    return np.stack([stream[s: s + length + 1] for s in starts])


def save_hf(params, arch: LlamaArch, out: pathlib.Path, tokenizer_dir: pathlib.Path,
            card: str) -> None:
    import torch
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    ours = {tuple(path): np.array(var.get_value())
            for path, var in nnx.to_flat_state(params)}
    hf_config = LlamaConfig(**{k: v for k, v in CONFIG.items()
                               if k not in ("architectures", "model_type", "dtype")})
    model = HFLlama(hf_config)
    state = {}
    for name, tensor in model.state_dict().items():
        target = hf_param_path(name, arch)
        if target is None:
            continue
        path, transform = target
        value = ours[path]
        if transform is not None:
            shape = tuple(tensor.shape)
            value = value.reshape(shape[::-1]).T if len(shape) == 2 else value.reshape(shape)
        state[name] = torch.from_numpy(np.ascontiguousarray(value))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise RuntimeError(f"weight mapping failed: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(out)
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, out / path.name)
    (out / "README.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="jaxserve/default_model")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=55.0, help="stop early after this")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=250)
    args = parser.parse_args()
    start = time.perf_counter()
    out = pathlib.Path(args.out)

    from transformers import AutoTokenizer

    train_files, held_files = split_files()
    tok_dir = pathlib.Path(tempfile.mkdtemp())
    load_tiny_script().train_tokenizer(tok_dir, files=train_files, vocab_size=VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    train, held = encode(tokenizer, train_files), encode(tokenizer, held_files)
    print(f"corpus: {len(train_files)} train files ({len(train):,} tokens), {len(held_files)} "
          f"held-out files from {', '.join(HELD_OUT)} ({len(held):,} tokens); "
          f"{time.perf_counter() - start:.0f} s", flush=True)

    arch = LlamaArch.from_hf(CONFIG)
    graphdef, params = init_params(arch, args.seed)
    count = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"model: {count:,} parameters", flush=True)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(200, args.steps // 10),
                                                  args.steps, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.95, weight_decay=0.1))
    opt_state = optimizer.init(params)
    loss_fn = make_loss(graphdef, arch, args.batch_size, args.seq_len)

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    eval_rng = np.random.default_rng(args.seed + 1)
    held_batches = [sample_batches(held, args.batch_size, args.seq_len, eval_rng)
                    for _ in range(8)]

    def held_perplexity() -> float:
        return math.exp(float(np.mean([eval_loss(params, b) for b in held_batches])))

    rng = np.random.default_rng(args.seed)
    losses, step = [], 0
    for step in range(1, args.steps + 1):
        tokens = sample_batches(train, args.batch_size, args.seq_len, rng)
        params, opt_state, loss = train_step(params, opt_state, tokens)
        losses.append(float(loss))
        if step % 50 == 0:
            print(f"step {step}: train loss {np.mean(losses[-50:]):.3f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if step % args.eval_every == 0:
            print(f"step {step}: held-out perplexity {held_perplexity():.2f}", flush=True)
        if time.perf_counter() - start > args.minutes * 60:
            print(f"time budget reached: stopping at step {step} of {args.steps}", flush=True)
            break
    minutes = (time.perf_counter() - start) / 60
    final_train = float(np.mean(losses[-50:]))
    ppl = held_perplexity()
    print(f"done: {step} steps in {minutes:.1f} min, train loss {final_train:.3f}, "
          f"held-out perplexity {ppl:.2f}", flush=True)
    card = MODEL_CARD.format(params=count, steps=step, batch=args.batch_size,
                             seq=args.seq_len, tokens=step * args.batch_size * args.seq_len,
                             minutes=minutes, loss=final_train, ppl=ppl,
                             held=", ".join(HELD_OUT), vocab=VOCAB,
                             config=json.dumps({k: CONFIG[k] for k in (
                                 "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads")}))
    if out.exists():
        shutil.rmtree(out)
    save_hf(params, arch, out, tok_dir, card)
    print(f"wrote {out}", flush=True)


MODEL_CARD = """# jaxserve default model

A small Llama-architecture model trained by `scripts/train_default_model.py` so that
jaxserve works out of the box without downloading anything. It writes Python-looking code;
it knows nothing else.

- Architecture: LlamaForCausalLM, {params:,} parameters, {config}, tied embeddings,
  byte-level BPE tokenizer with {vocab} tokens (trained on the same files), ChatML template.
- Data: the CPython standard library's `.py` files (tests excluded). The packages {held}
  are held out: never trained on, used for the perplexity below.
- Training: {steps} steps of AdamW, batch {batch} x {seq} tokens ({tokens:,} tokens),
  {minutes:.1f} minutes on 2 CPU cores.
- Final train loss {loss:.3f}; held-out perplexity {ppl:.2f}.
- Weights: bfloat16 safetensors.
"""


if __name__ == "__main__":
    main()
