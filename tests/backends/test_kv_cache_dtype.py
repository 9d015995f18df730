"""A bf16 KV cache costs what a step reads: no whole-cache convert, copy or transpose.

XLA:CPU widens bf16 gathers and scatters to f32 by converting their whole operand; with the
cache as an operand that made every step convert every block (ref.kv_storage_dtype). The
compiled step is checked structurally: apart from the updated cache itself (the scatter), no
instruction may produce an array with as many elements as the cache.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.attention_cases import assert_close, make_case
from support.cache_hlo import NUM_BLOCKS, whole_cache_arrays

from jaxserve import LLM, SamplingParams
from jaxserve.kernels_pallas import cpu_attention, ref


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_bf16_step_never_touches_the_whole_cache(tiny_checkpoint, backend):
    llm = LLM(str(tiny_checkpoint), dtype="bfloat16", num_kv_blocks=NUM_BLOCKS,
              attention_backend=backend, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=64, precompile=False, compilation_cache_dir=None)
    runner = llm.engine.runner
    k_cache = runner.kv_caches[0][0]
    assert k_cache.dtype == jnp.uint16  # the bf16 bits (kv_storage_dtype on the CPU)
    # Every bucket's step holds the same three attention parts (step tokens, decode context,
    # chunk context) and the same KV write: one bucket shows them all.
    hlo = runner._compile_step(16, 2).as_text()
    assert whole_cache_arrays(hlo, k_cache.size) == []
    # And the check can fail: the same step over a bf16-typed cache converts it in full.
    naive = jax.jit(lambda c, i: c[i].astype(jnp.float32).sum())
    hlo = naive.lower(jnp.zeros(k_cache.shape, jnp.bfloat16), jnp.arange(4)).compile().as_text()
    assert whole_cache_arrays(hlo, k_cache.size)


@pytest.mark.parametrize("impl", [ref.ragged_paged_attention, cpu_attention.ragged_paged_attention],
                         ids=["reference", "cpu_attention"])
def test_bits_storage_reads_the_same_values(impl):
    """A cache stored as uint16 bits attends exactly as the same cache stored as bf16."""
    rng = np.random.default_rng(3)
    specs = [(1, 40), (9, 30), (1, 3), (17, 17)]
    q, k_cache, v_cache, batch = make_case(rng, specs, block_size=8, num_kv_heads=2,
                                           num_heads=4, head_dim=32, dtype="bfloat16")
    storage = ref.kv_storage_dtype(jnp.bfloat16, "cpu")
    assert storage == jnp.uint16 and ref.kv_storage_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16
    bits = lambda c: jax.lax.bitcast_convert_type(c, storage)
    want = impl(q, k_cache, v_cache, batch, scale=0.2)
    got = impl(q, bits(k_cache), bits(v_cache), batch, scale=0.2)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert_close(got, want, batch, "bfloat16")
    # write_kv stores the bits of the new keys; reading them back gives the keys.
    new = jnp.asarray(rng.standard_normal((q.shape[0], 2, 32)), jnp.bfloat16)
    k_bits, _ = ref.write_kv(bits(k_cache), bits(v_cache), new, new, batch.slot_mapping)
    k_plain, _ = ref.write_kv(k_cache, v_cache, new, new, batch.slot_mapping)
    assert k_bits.dtype == storage
    np.testing.assert_array_equal(np.asarray(ref.values(k_bits, jnp.bfloat16), np.float32),
                                  np.asarray(k_plain, np.float32))


def test_bf16_generation_matches_across_backends(tiny_checkpoint):
    """The CPU's bits-stored bf16 cache gives the same greedy text on cpu_attention and the
    reference (both read the same bf16 values)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["def add(a, b):", "import os\nimport sys\n"]
    outs = {}
    for backend in ("auto", "reference"):
        llm = LLM(str(tiny_checkpoint), dtype="bfloat16", attention_backend=backend,
                  max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                  precompile=False)
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]
    assert outs["auto"] == outs["reference"]
    # The per-request bias row (logit_bias, allowed_token_ids) in a bf16 model: it is added
    # to the float32 logits whatever the model's dtype.
    forced = llm.generate(prompts[:1], params.clone(logit_bias={42: 100.0}), use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42] * 12
    allowed = llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True, seed=1,
                                                       allowed_token_ids=[7, 9]),
                           use_tqdm=False)
    assert set(allowed[0].outputs[0].token_ids) <= {7, 9}
    # and a grammar's bitmask (structured outputs) in the same bf16 model
    regex = SamplingParams(max_tokens=20, temperature=1.0, seed=4,
                           structured_outputs={"regex": "[a-d]{3}-[0-9]{2}"})
    out = llm.generate(prompts[:1], regex, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[a-d]{3}-[0-9]{2}", out.text)
