"""Pooling models (runner="pooling"): embeddings, classification and scores through the
engine's scheduler, batching and prefix cache, against Hugging Face transformers.

The tiny pooling checkpoints (tests/support/pooling_helpers.py) are built once beside the tiny test
checkpoints (conftest.pooling_checkpoints). Every default engine here has one shape
(pooling_refs.POOL_ENGINE: 16-token steps of at
most 2 sequences, a 10-block KV cache, the reference attention) so that the checkpoints of
one architecture share their compiled steps through the executable cache: prompts longer
than a step are prefilled in chunks, more prompts than max_num_seqs wait, and the small
cache preempts."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest
from support.pooling_helpers import write_sentence_transformers
from support.pooling_refs import (
    COSINE_F32,
    POOL_ENGINE,
    cosine_distance,
    hf_hidden,
    hf_probs,
    random_prompts,
    unit,
)

from jaxserve import LLM, PoolingParams, SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.outputs import EmbeddingRequestOutput, PoolingRequestOutput


# ---- configuration ------------------------------------------------------------------------
def _pooler(folder, **kwargs):
    return EngineConfig.create(str(folder), max_model_len=128, precompile=False,
                               **kwargs).pooler


def test_runner_and_convert_resolve_as_vllms(pooling_checkpoints, tiny_checkpoints):
    embed = _pooler(pooling_checkpoints["qwen3-embed"])
    assert (embed.task, embed.pooling_type, embed.normalize) == ("embed", "LAST", True)
    assert embed.matryoshka_dimensions == ()  # config.json's is_matryoshka
    classify = _pooler(pooling_checkpoints["llama-cls3"])
    assert (classify.task, classify.num_labels, classify.labels) == (
        "classify", 3, ("LABEL_0", "LABEL_1", "LABEL_2"))
    st = _pooler(pooling_checkpoints["qwen3-st-mean"])  # a ForCausalLM: modules.json decides
    assert (st.task, st.pooling_type, st.normalize) == ("embed", "MEAN", True)
    assert _pooler(tiny_checkpoints["llama"]) is None  # a generative model generates
    converted = _pooler(tiny_checkpoints["llama"], runner="pooling")
    assert (converted.task, converted.pooling_type) == ("embed", "LAST")
    assert _pooler(tiny_checkpoints["llama"], convert="embed").task == "embed"
    options = _pooler(pooling_checkpoints["qwen3-st-mean"],
                      pooler_config='{"pooling_type": "cls", "normalize": false}')
    assert (options.pooling_type, options.normalize) == ("CLS", False)
    no_act = _pooler(pooling_checkpoints["llama-cls1"], pooler_config={"activation": False})
    assert no_act.use_activation is False


@pytest.mark.parametrize("kind, kwargs, message", [
    ("qwen3-embed", dict(runner="generate"), "is a pooling model.*runner='pooling'"),
    ("llama", dict(runner="pooling", convert="classify"), "needs a .*ForSequenceClassification"),
    ("llama", dict(runner="pooling", convert="none"), "convert='embed'"),
    ("llama", dict(runner="generate", convert="embed"), "makes a pooling model"),
    ("llama", dict(pooler_config={"pooling_type": "MEAN"}), "applies to pooling models"),
    ("qwen3-embed", dict(pooler_config={"pooling_type": "MAX"}), "LAST, MEAN, CLS"),
    ("qwen3-embed", dict(pooler_config={"step_tag_id": 3}), "step_tag_id not supported"),
    ("qwen3-embed", dict(pooler_config={"enable_chunked_processing": True}),
     "enable_chunked_processing"),
    ("qwen3-embed", dict(pooler_config={"use_activation": False}), "does not apply to embed"),
    ("llama-cls3", dict(pooler_config={"normalize": True}), "does not apply to classify"),
    ("qwen3-embed", dict(pooler_config={"dimensions": 65}), "at most the model's hidden size"),
    ("qwen3-embed", dict(pooler_config="{"), "not valid JSON"),
    ("qwen3-embed", dict(runner="embed"), "runner must be one of"),
    ("qwen3-embed", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "generates no tokens to speculate on"),
])
def test_pooling_settings_that_cannot_apply_are_refused(pooling_checkpoints, tiny_checkpoints,
                                                        kind, kwargs, message):
    folder = tiny_checkpoints.get(kind) or pooling_checkpoints[kind]
    with pytest.raises(ValueError, match=message):
        _pooler(folder, **kwargs)


def test_sentence_transformers_files_are_read_or_refused(pooling_checkpoints, tmp_path):
    folder = tmp_path / "st"
    shutil.copytree(pooling_checkpoints["qwen3-st-mean"], folder)
    write_sentence_transformers(folder, "pooling_mode_cls_token", normalize=False)
    assert (_pooler(folder).pooling_type, _pooler(folder).normalize) == ("CLS", False)
    write_sentence_transformers(folder, "pooling_mode_max_tokens", normalize=True)
    with pytest.raises(ValueError, match="exactly one of pooling_mode_lasttoken"):
        _pooler(folder)
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    write_sentence_transformers(folder, "pooling_mode_lasttoken", True, (dense,))
    with pytest.raises(ValueError, match="module Dense is not supported"):
        _pooler(folder)


# ---- embeddings ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(pooling_checkpoints):
    """Qwen3Model (LAST, normalized; Matryoshka), every bucket compiled up front."""
    llm = LLM(str(pooling_checkpoints["qwen3-embed"]), precompile=True,
              request_limits={"max_embedding_inputs": 8}, **POOL_ENGINE)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def qwen3_mean(pooling_checkpoints):
    """The same checkpoint pooled by MEAN (pooler_config): the same compiled steps."""
    llm = LLM(str(pooling_checkpoints["qwen3-embed"]), pooler_config={"pooling_type": "MEAN"},
              **POOL_ENGINE)
    yield llm
    llm.close()


def test_last_token_embeddings_equal_transformers_under_scheduler_pressure(
        qwen3, pooling_checkpoints):
    # Seven prompts for two sequences at a time, up to max_model_len long: 16-token chunks,
    # and a KV cache of 9 usable blocks for prompts of up to 8 blocks (the 60-token prompt
    # starts beside the 120-token one's last chunk and is preempted).
    prompts = random_prompts([3, 120, 60, 17, 128, 40, 90])
    before = qwen3.engine.num_preemptions
    outputs = qwen3.embed(prompts, use_tqdm=False)
    assert qwen3.engine.num_preemptions > before, "the small KV cache should have preempted"
    folder = pooling_checkpoints["qwen3-embed"]
    for ids, output in zip(prompts, outputs):
        assert isinstance(output, EmbeddingRequestOutput) and output.finished
        assert output.prompt_token_ids == ids and output.outputs.hidden_size == 64
        assert abs(np.linalg.norm(output.outputs.embedding) - 1) < 1e-5
        assert cosine_distance(output.outputs.embedding, hf_hidden(folder, ids)[-1]) < COSINE_F32
    texts = ["def main():\n    return 0", "import os"]
    for text, output in zip(texts, qwen3.embed(texts, use_tqdm=False)):
        ids = qwen3.get_tokenizer()(text)["input_ids"]
        assert output.prompt_token_ids == ids and output.prompt == text
        assert cosine_distance(output.outputs.embedding, hf_hidden(folder, ids)[-1]) < COSINE_F32
    assert not qwen3.engine.has_unfinished_requests()
    assert qwen3.engine.stats().kv_usage == 0.0, "a finished pooling request keeps no blocks"


def test_last_token_pooling_reads_the_prefix_cache(qwen3, pooling_checkpoints):
    prefix, = random_prompts([48], seed=3)
    first, second = (prefix + tail for tail in random_prompts([5, 7], seed=4))
    qwen3.embed([first], use_tqdm=False)
    hits = qwen3.engine.prefix_cache_stats.hits
    output, = qwen3.embed({"prompt_token_ids": second}, use_tqdm=False)
    assert qwen3.engine.prefix_cache_stats.hits - hits == 48, "three cached blocks"
    assert output.num_cached_tokens == 48
    folder = pooling_checkpoints["qwen3-embed"]
    assert cosine_distance(output.outputs.embedding, hf_hidden(folder, second)[-1]) < COSINE_F32


def test_matryoshka_dimensions_truncation_and_settings(qwen3, pooling_checkpoints):
    ids, = random_prompts([30], seed=5)
    raw = hf_hidden(pooling_checkpoints["qwen3-embed"], ids)[-1]
    params = [PoolingParams(dimensions=16), PoolingParams(normalize=False),
              PoolingParams(dimensions=8, normalize=False), PoolingParams(truncate_prompt_tokens=9)]
    short, plain, short_plain, truncated = qwen3.embed([ids] * 4, params, use_tqdm=False)
    assert len(short.outputs.embedding) == 16
    assert cosine_distance(short.outputs.embedding, raw[:16]) < COSINE_F32
    assert abs(np.linalg.norm(short.outputs.embedding) - 1) < 1e-5  # renormalized
    np.testing.assert_allclose(plain.outputs.embedding, raw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(short_plain.outputs.embedding, raw[:8], rtol=1e-4, atol=1e-4)
    assert truncated.prompt_token_ids == ids[-9:]
    last9 = hf_hidden(pooling_checkpoints["qwen3-embed"], ids[-9:])[-1]
    assert cosine_distance(truncated.outputs.embedding, last9) < COSINE_F32
    same = qwen3.embed([ids], truncate_prompt_tokens=9, use_tqdm=False)[0]
    assert same.outputs.embedding == truncated.outputs.embedding
    data = qwen3.encode([ids], use_tqdm=False)[0]
    assert isinstance(data, PoolingRequestOutput) and data.outputs.data.dtype == np.float32
    with pytest.raises(ValueError, match="at most the model's hidden size 64"):
        qwen3.embed([ids], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be >= 1"):
        PoolingParams(dimensions=0)
    # use_activation: vLLM's current name for an embedding's normalization
    unnormalized = qwen3.embed([ids], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert unnormalized.outputs.embedding == plain.outputs.embedding
    with pytest.raises(ValueError, match="use_activation and normalize disagree"):
        qwen3.embed([ids], PoolingParams(use_activation=False, normalize=True),
                    use_tqdm=False)


def test_mean_pooling_sums_chunks_and_ignores_the_prefix_cache(qwen3_mean,
                                                                pooling_checkpoints):
    folder = pooling_checkpoints["qwen3-embed"]
    prefix, = random_prompts([48], seed=6)
    # (the 60-token prompt is preempted after its first chunk: its sum starts over)
    prompts = random_prompts([3, 120, 60], seed=7) + [
        prefix + tail for tail in random_prompts([5, 70, 1], seed=8)] + [prefix]
    hits, preempted = (qwen3_mean.engine.prefix_cache_stats.hits,
                       qwen3_mean.engine.num_preemptions)
    outputs = qwen3_mean.embed(prompts, use_tqdm=False)
    assert qwen3_mean.engine.num_preemptions > preempted
    assert qwen3_mean.engine.prefix_cache_stats.hits == hits, "MEAN reads every position"
    for ids, output in zip(prompts, outputs):
        assert output.num_cached_tokens == 0
        mean = hf_hidden(folder, ids).mean(axis=0)
        assert cosine_distance(output.outputs.embedding, mean) < COSINE_F32


def test_sentence_transformers_causal_lm_embeds_as_configured(pooling_checkpoints):
    """A *ForCausalLM with modules.json (Qwen3-Embedding's layout): MEAN and Normalize from
    its files, served as an embedding model without runner or convert."""
    folder = pooling_checkpoints["qwen3-st-mean"]
    with LLM(str(folder), **POOL_ENGINE) as llm:
        prompts = random_prompts([20, 3], seed=9)
        for ids, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            mean = hf_hidden(folder, ids).mean(axis=0)
            assert cosine_distance(output.outputs.embedding, mean) < COSINE_F32


def test_llama_embeddings_cls_pooling_and_refusals(pooling_checkpoints, tiny_checkpoints):
    folder = pooling_checkpoints["llama-embed"]
    prompts = random_prompts([25, 6], seed=10)
    with LLM(str(folder), **POOL_ENGINE) as llm:
        for ids, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            assert cosine_distance(output.outputs.embedding,
                                   hf_hidden(folder, ids)[-1]) < COSINE_F32
        with pytest.raises(ValueError, match="does not support Matryoshka"):
            llm.embed(prompts, PoolingParams(dimensions=8), use_tqdm=False)
        with pytest.raises(ValueError, match="served for pooling.*generates no text"):
            llm.generate("def", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="task 'classify' needs a classification model"):
            llm.classify(prompts, use_tqdm=False)
        with pytest.raises(ValueError, match="may be at most max_model_len=128"):
            llm.embed([list(range(5, 134))], use_tqdm=False)
        with pytest.raises(ValueError, match="cannot be greater than max_model_len"):
            llm.embed(prompts, truncate_prompt_tokens=129, use_tqdm=False)
    with LLM(str(folder), pooler_config={"pooling_type": "CLS"}, **POOL_ENGINE) as llm:
        for ids, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            assert cosine_distance(output.outputs.embedding,
                                   hf_hidden(folder, ids)[0]) < COSINE_F32
    with LLM(str(tiny_checkpoints["llama"]), max_model_len=128) as generator, \
            pytest.raises(ValueError, match="This model generates text.*runner='pooling'"):
        generator.embed(["def"], use_tqdm=False)


@pytest.mark.slow  # (the suite's budget: MEAN is checked by default on qwen3's steps)
def test_llama_mean_pooling_equals_transformers(pooling_checkpoints):
    """LlamaModel pooled by MEAN under chunked prefill (prompts longer than a step): the
    mean of transformers' hidden states, normalized."""
    folder = pooling_checkpoints["llama-embed"]
    prompts = random_prompts([40, 7, 23], seed=12)
    with LLM(str(folder), pooler_config={"pooling_type": "MEAN"}, **POOL_ENGINE) as llm:
        for ids, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            assert cosine_distance(output.outputs.embedding,
                                   hf_hidden(folder, ids).mean(axis=0)) < COSINE_F32
            assert abs(np.linalg.norm(output.outputs.embedding) - 1) < 1e-5


def test_bi_encoder_score_is_the_cosine_of_the_embeddings(qwen3, pooling_checkpoints):
    folder = pooling_checkpoints["qwen3-embed"]
    tokenizer = qwen3.get_tokenizer()
    query, docs = "def main", ["import os", "return None", "import os"]
    one_to_many = qwen3.score(query, docs, use_tqdm=False)
    pairs = qwen3.score(["class A", "x = 1"], ["class B", "y = 2"], use_tqdm=False)
    hidden = {t: hf_hidden(folder, tokenizer(t)["input_ids"])[-1]
              for t in [query, *docs, "class A", "x = 1", "class B", "y = 2"]}
    for output, doc in zip(one_to_many, docs):
        assert abs(output.outputs.score - unit(hidden[query]) @ unit(hidden[doc])) < 1e-5
    assert one_to_many[0].outputs.score == one_to_many[2].outputs.score
    for output, (a, b) in zip(pairs, [("class A", "class B"), ("x = 1", "y = 2")]):
        assert abs(output.outputs.score - unit(hidden[a]) @ unit(hidden[b])) < 1e-5
    with pytest.raises(ValueError, match="data_1 has 2 inputs and data_2 3"):
        qwen3.score(["a", "b"], docs, use_tqdm=False)
    with pytest.raises(ValueError, match="data_2: .*limited to 8 .*max_embedding_inputs"):
        qwen3.score("a", ["b"] * 9, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: .*limited to 8 .*max_embedding_inputs"):
        qwen3.embed(["b"] * 9, use_tqdm=False)


def test_no_compilation_after_warm_up_across_pooling_requests(qwen3):
    before = qwen3.engine.num_compilations
    rng = np.random.default_rng(11)
    prompts = random_prompts(rng.integers(1, 129, 8), seed=12)
    params = [PoolingParams(dimensions=int(rng.choice([4, 32, 64])),
                            normalize=bool(rng.integers(2)),
                            truncate_prompt_tokens=int(rng.choice([-1, 50])))
              for _ in prompts]
    assert len(qwen3.embed(prompts, params, use_tqdm=False)) == 8
    qwen3.score("a b c", ["d", "e f", "g"], use_tqdm=False)
    qwen3.encode(prompts[:3], use_tqdm=False)
    assert qwen3.engine.num_compilations == before


# ---- classification and cross-encoders ----------------------------------------------------
@pytest.mark.parametrize("kind", [
    "llama-cls3", pytest.param("qwen2-cls3", marks=pytest.mark.slow)])
def test_classify_equals_transformers_softmax(pooling_checkpoints, kind):
    folder = pooling_checkpoints[kind]
    prompts = random_prompts([20, 4, 50], seed=13)
    with LLM(str(folder), **POOL_ENGINE) as llm:
        outputs = llm.classify(prompts, use_tqdm=False)
        raw = llm.classify(prompts[:1], PoolingParams(use_activation=False), use_tqdm=False)
        with pytest.raises(ValueError, match="score needs .*this classifier has 3"):
            llm.score("a", ["b"], use_tqdm=False)
        with pytest.raises(ValueError, match="normalize does not apply"):
            llm.classify(prompts, PoolingParams(normalize=True), use_tqdm=False)
        with pytest.raises(ValueError, match="task 'embed' needs an embedding model"):
            llm.embed(prompts, use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert output.outputs.num_classes == 3
        np.testing.assert_allclose(output.outputs.probs, hf_probs(folder, ids), atol=1e-5)
    np.testing.assert_allclose(raw[0].outputs.probs, hf_probs(folder, prompts[0], False),
                               atol=1e-4)


def test_cross_encoder_classify_and_score_equal_transformers_sigmoid(pooling_checkpoints):
    folder = pooling_checkpoints["llama-cls1"]
    # (one sequence per step: one compiled bucket; the other tests batch two)
    with LLM(str(folder), **{**POOL_ENGINE, "max_num_seqs": 1}) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = random_prompts([9, 33], seed=14)
        for ids, output in zip(prompts, llm.classify(prompts, use_tqdm=False)):
            np.testing.assert_allclose(output.outputs.probs, hf_probs(folder, ids), atol=1e-5)
        query, docs = "what is os", ["import os", "def f(): pass"]
        scores = llm.score(query, docs, use_tqdm=False)
        with pytest.raises(ValueError, match="data_.: a cross-encoder .* give the inputs as strings"):
            llm.score([[5, 6]], [[7, 8]], use_tqdm=False)
    for output, doc in zip(scores, docs):
        pair = tokenizer(query, doc, return_tensors="pt")
        assert output.prompt_token_ids == pair["input_ids"][0].tolist()
        assert abs(output.outputs.score - float(hf_probs(folder, dict(pair))[0])) < 1e-5


# ---- other engines ------------------------------------------------------------------------
def test_torch_backend_pools_as_the_jax_backend(pooling_checkpoints, qwen3_mean):
    pytest.importorskip("torch")
    prompts = random_prompts([40, 7, 3], seed=15)
    want = [o.outputs.embedding for o in qwen3_mean.embed(prompts, use_tqdm=False)]
    with LLM(str(pooling_checkpoints["qwen3-embed"]), backend="torch",
             pooler_config={"pooling_type": "MEAN"}, **POOL_ENGINE) as llm:
        got = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    for a, b in zip(want, got):
        assert cosine_distance(a, b) < COSINE_F32
    folder = pooling_checkpoints["llama-cls3"]
    with LLM(str(folder), backend="torch", **POOL_ENGINE) as llm:
        probs = llm.classify(prompts, use_tqdm=False)
    for ids, output in zip(prompts, probs):
        np.testing.assert_allclose(output.outputs.probs, hf_probs(folder, ids), atol=1e-5)


def test_async_engine_encodes_and_stats_count_pooling_requests(qwen3_mean):
    from jaxserve.engine.admission import EngineRequest
    from jaxserve.server.async_engine import AsyncLLMEngine
    from jaxserve.server.metrics import EngineMetrics

    engine, processor = qwen3_mean.engine, qwen3_mean.engine.processor
    prompts = random_prompts([30, 5, 12], seed=16)
    want = [o.outputs.embedding for o in qwen3_mean.embed(prompts, use_tqdm=False)]
    requests = [processor.process_pooling(f"async-{i}", None, ids, PoolingParams())
                for i, ids in enumerate(prompts)]
    for request in requests:  # the engine's counters hold them as any request
        engine.add_processed(request)
    stats = engine.stats()
    assert (stats.waiting, stats.unfinished_requests) == (3, 3)
    for request in requests:
        engine.abort_request(request.request_id)
    assert engine.stats().unfinished_requests == 0

    metrics = EngineMetrics("pool")

    async def encode():
        server = AsyncLLMEngine(engine, metrics=metrics, log_requests=True, log_outputs=True)
        server.start()
        try:
            with pytest.raises(ValueError, match="encode takes pooling requests"):
                await server.encode(EngineRequest("gen", None, [5, 6], SamplingParams()))
            return await server.encode_many(requests)
        finally:
            server.stop()

    outputs = asyncio.run(encode())
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for output, embedding in zip(outputs, want):
        assert output.finished and output.finish_reason == "stop"
        np.testing.assert_allclose(output.outputs.data, embedding, atol=1e-6)
    rendered = metrics.render().decode()
    assert 'vllm:request_success_total{finished_reason="stop",model_name="pool"} 3.0' in rendered
    assert 'vllm:prompt_tokens_total{model_name="pool"} 47.0' in rendered


@pytest.mark.slow
def test_engine_core_process_sends_pooled_outputs(pooling_checkpoints, qwen3):
    from jaxserve.config.engine_args import EngineArgs
    from jaxserve.engine.core_client import EngineCoreClient
    from jaxserve.engine.data_parallel import create_engine

    folder = str(pooling_checkpoints["qwen3-embed"])
    config = EngineArgs.from_kwargs(model=folder, **POOL_ENGINE).engine_config(
        folder, on_accelerator=False, default_precompile=False)
    prompts = random_prompts([70, 5, 128], seed=18)
    params = [PoolingParams(), PoolingParams(dimensions=8), PoolingParams(normalize=False)]
    want = qwen3.embed(prompts, params, use_tqdm=False)
    client = EngineCoreClient(create_engine, (config,))
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            client.add_processed(client.processor.process_pooling(f"core-{i}", None, ids, p))
        finals = {}
        while client.has_unfinished_requests():
            finals.update((o.request_id, o) for o in client.step() if o.finished)
    finally:
        client.close()
    for i, expected in enumerate(want):
        output = finals[f"core-{i}"]
        assert isinstance(output, PoolingRequestOutput) and output.finish_reason == "stop"
        np.testing.assert_allclose(output.outputs.data, expected.outputs.embedding, atol=1e-6)


@pytest.mark.slow
def test_bfloat16_pooling_is_as_close_to_transformers_as_its_own_bfloat16(pooling_checkpoints):
    """Real checkpoints are bfloat16: the default attention in bfloat16, against
    transformers in float32, within a few times transformers' own bfloat16 error."""
    engine = dict(dtype="bfloat16", max_model_len=128, max_num_batched_tokens=32,
                  max_num_seqs=4)
    prompts = random_prompts([70, 5, 20], seed=17)
    folder = pooling_checkpoints["qwen3-embed"]
    with LLM(str(folder), **engine) as llm:
        for ids, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
            assert cosine_distance(output.outputs.embedding, hf_hidden(folder, ids)[-1]) < 1e-3
    folder = pooling_checkpoints["llama-cls3"]
    with LLM(str(folder), **engine) as llm:
        for ids, output in zip(prompts, llm.classify(prompts, use_tqdm=False)):
            exact = hf_probs(folder, ids)
            own = np.abs(hf_probs(folder, ids, dtype="bfloat16") - exact).max()
            assert np.abs(np.asarray(output.outputs.probs) - exact).max() <= max(3 * own, 5e-3)
