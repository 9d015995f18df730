"""Automatic prefix caching: the block pool and hash chain without a model, then the tiny
llama end to end (cache on and off give the same tokens).

The host-side tests drive the scheduler through test_scheduler's Harness with caching on:
its fake runner writes every scheduled token into a simulated paged KV cache and reads each
sampled row's context back through its block table, so a hit on a wrong or stale block
changes the tokens; after every step it also checks that each cached block holds exactly the
tokens its hash names, and that only cached full blocks are shared.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from support.scheduler_harness import VOCAB, Harness, cdiv

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine_config import CacheConfig
from jaxserve.core.kv_cache_manager import ROOT_HASH, BlockPool, KVCacheManager, hash_block
from jaxserve.core.request import Request, RequestStatus


def held_blocks(request) -> list:
    """A request's blocks (its one KV group's list; [] while it holds none)."""
    return request.block_ids[0] if request.block_ids else []


def request(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   seed=0, max_model_len=512, eos_token_ids=frozenset())


def tokens(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


# ---- hash chain ---------------------------------------------------------------------------
def test_hash_chain_names_the_whole_prefix():
    kv = KVCacheManager(10, 4)
    base = tokens(0, 14)  # 3 full blocks and 2 tokens
    a = kv.update_block_hashes(request("a", base))
    assert len(a) == 3 and len(set(a)) == 3
    assert kv.update_block_hashes(request("b", base)) == a, "same tokens, same hashes"
    assert a[0] == hash_block(ROOT_HASH, np.asarray(base[:4], np.int32))
    assert a[1] == hash_block(a[0], np.asarray(base[4:8], np.int32))

    late = kv.update_block_hashes(request("c", base[:9] + [base[9] + 1] + base[10:]))
    assert late[:2] == a[:2] and late[2] != a[2], "a change in block 2 leaves blocks 0-1"
    early = kv.update_block_hashes(request("d", [base[0] + 1] + base[1:]))
    assert not set(early) & set(a), "a change in block 0 changes every later block (chain)"
    shifted = request("e", base)
    shifted.extra_keys = ("lora-1",)
    assert not set(kv.update_block_hashes(shifted)) & set(a), "extra keys take part"
    assert hash_block(ROOT_HASH, np.arange(4), ()) != hash_block(ROOT_HASH, np.arange(4), (0,))


def test_block_hashes_grow_with_outputs_incrementally():
    kv = KVCacheManager(10, 4)
    req = request("a", tokens(1, 6), max_tokens=8)
    first = list(kv.update_block_hashes(req))
    assert len(first) == 1
    req.append_token(7)
    assert kv.update_block_hashes(req) == first, "block 1 is not full yet"
    req.append_token(8)
    hashes = kv.update_block_hashes(req)
    assert hashes[0] is first[0] and len(hashes) == 2, "old hashes are kept, not recomputed"
    assert hashes[1] == hash_block(first[0], req.token_ids[4:8])


# ---- block pool ---------------------------------------------------------------------------
def test_free_queue_is_lru_and_allocation_evicts_the_hash():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    assert blocks == [1, 2, 3, 4, 5]
    for b in blocks:
        pool.register(b, bytes([b]))
    pool.release([3, 1])
    pool.release([5])
    assert pool.free_order() == [3, 1, 5] and pool.num_free == 3
    assert pool.num_cached == 5, "free blocks keep their hash"
    assert pool.allocate(1) == [3], "least recently freed first"
    assert bytes([3]) not in pool.cached and 3 not in pool.block_hash, "evicted on reuse"
    assert pool.cached[bytes([1])] == 1
    pool.register(3, bytes([1]))  # a hash already cached elsewhere: the duplicate stays unnamed
    assert pool.cached[bytes([1])] == 1 and 3 not in pool.block_hash


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(5)
    a = pool.allocate(2)
    pool.register(a[0], b"x")
    pool.release(a)
    assert pool.free_order() == [3, 4, *a]
    pool.touch([a[0]])  # a hit on a free cached block
    assert pool.ref_counts[a[0]] == 1 and not pool.is_free(a[0])
    assert pool.free_order() == [3, 4, a[1]] and pool.num_free == 3
    pool.touch([a[0]])  # a second holder
    assert pool.ref_counts[a[0]] == 2
    pool.release([a[0]])
    assert not pool.is_free(a[0])
    pool.release([a[0]])
    assert pool.free_order()[-1] == a[0] and pool.cached[b"x"] == a[0]


def test_a_request_frees_tail_first_so_its_tail_is_evicted_first():
    kv = KVCacheManager(8, 4)
    req = request("a", tokens(2, 13))
    assert kv.allocate_slots(req, 13)
    held = list(held_blocks(req))
    assert len(held) == 4 and kv.pool.num_cached == 3  # the partial block is not cached
    kv.free(req)
    assert kv.pool.free_order()[-4:] == held[::-1]
    assert kv.pool.allocate(4) == [5, 6, 7, held[-1]], "the tail goes before the head"
    assert kv.pool.num_cached == 3


# ---- lookup -------------------------------------------------------------------------------
def run_one(kv: KVCacheManager, req: Request, num_tokens: int | None = None) -> None:
    """Admit req with its hits and compute its prompt, as scheduler and engine do."""
    hits = kv.get_computed_blocks(req)
    num_hit = len(hits) * kv.block_size
    assert kv.allocate_slots(req, (num_tokens or req.num_tokens) - num_hit, hits)
    req.num_computed_tokens = num_tokens or req.num_tokens
    kv.record_lookup(req, num_hit)


def test_hits_leave_at_least_the_last_token_to_compute():
    kv = KVCacheManager(20, 4)
    base = tokens(3, 16)
    run_one(kv, request("a", base))
    assert kv.pool.num_cached == 4
    assert len(kv.get_computed_blocks(request("same", base))) == 3, "16 tokens: 12 cached"
    assert len(kv.get_computed_blocks(request("longer", base + [1]))) == 4
    assert len(kv.get_computed_blocks(request("shorter", base[:13]))) == 3
    assert len(kv.get_computed_blocks(request("tiny", base[:4]))) == 0
    assert len(kv.get_computed_blocks(request("diverges", base[:6] + [0] * 10))) == 1
    assert kv.queries == 16 and kv.hits == 0, "lookups count only when admitted"


def test_excluded_requests_compute_everything_but_register_for_others():
    kv = KVCacheManager(40, 4)
    base = tokens(4, 12)
    run_one(kv, request("a", base))
    for params in (dict(prompt_logprobs=1), dict(presence_penalty=0.5),
                   dict(frequency_penalty=-0.1), dict(repetition_penalty=1.2)):
        req = request("x", base + [5, 6, 7, 8, 9], **params)
        assert not req.reads_prefix_cache and kv.get_computed_blocks(req) == []
        run_one(kv, req)
        assert kv.queries == 12, "excluded lookups are not counted"
        kv.free(req)
    assert len(kv.get_computed_blocks(request("b", base + [5, 6, 7, 8, 9]))) == 4, \
        "the excluded requests registered their fourth block"


def test_failed_admission_changes_nothing():
    kv = KVCacheManager(7, 4)  # 6 usable blocks
    base = tokens(5, 8)
    first = request("a", base)
    run_one(kv, first)
    kv.free(first)
    other = request("b", tokens(6, 12))
    run_one(kv, other)  # 3 blocks held; free: 3 (two of them cached)
    order, refs = kv.pool.free_order(), kv.pool.ref_counts.copy()
    big = request("c", base + tokens(7, 12))  # 20 tokens: 2 hits + 3 new > 3 free - 2
    hits = kv.get_computed_blocks(big)
    assert len(hits) == 2
    assert not kv.allocate_slots(big, 12, hits)
    assert kv.pool.free_order() == order and (kv.pool.ref_counts == refs).all()
    assert held_blocks(big) == [] and kv.pool.num_cached == 5
    kv.free(other)
    assert kv.allocate_slots(big, 12, hits) and held_blocks(big)[:2] == hits


def test_caching_off_hashes_nothing():
    kv = KVCacheManager(20, 4, enable_caching=False)
    base = tokens(8, 16)
    run_one(kv, request("a", base))
    req = request("b", base)
    assert kv.get_computed_blocks(req) == [] and req.block_hashes == []
    assert kv.pool.num_cached == 0 and kv.queries == 0


# ---- scheduler ----------------------------------------------------------------------------
def shared_harness(**kwargs) -> Harness:
    return Harness(enable_caching=True, **kwargs)


def test_n_children_share_the_prompt_blocks_admitted_in_one_step():
    h = shared_harness(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = tokens(9, 18)  # 4 full blocks + 2 tokens
    children = [h.add(request(f"p#{i}", prompt, max_tokens=6)) for i in range(3)]
    out = h.step()
    assert out.requests == children
    assert out.num_scheduled_tokens == [18, 2, 2], "children 1-2 hit child 0's blocks"
    in_use = len({b for c in h.scheduler.running for b in held_blocks(c)})
    assert in_use == 5 + 1 + 1 < 3 * cdiv(18, 4)
    assert [c.num_cached_tokens for c in children] == [0, 16, 16]
    h.run()
    assert all(c.output_token_ids == children[0].output_token_ids for c in children)
    h.check_outputs()
    assert h.kv_manager.stats.queries == 54 and h.kv_manager.hits == 32


def test_a_request_admitted_later_in_the_same_step_hits_blocks_scheduled_before_it():
    h = shared_harness(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=12)
    prompt = tokens(10, 30)
    a = h.add(request("a", prompt))
    b = h.add(request("b", prompt + tokens(13, 5)))
    assert h.step().requests == [a]  # a: 12 tokens; the budget is spent
    assert h.step().requests == [a]  # a: 24
    out = h.schedule()  # a: its last 6 tokens fill block 6; b gets the 6 left
    assert out.requests == [a, b] and out.num_scheduled_tokens == [6, 6]
    assert b.num_cached_tokens == 28 and held_blocks(b)[:7] == held_blocks(a)[:7]
    h.execute(out)  # the fake runner writes the whole step before reading, as each layer does
    h.run()
    h.check_outputs()


def test_a_preempted_request_hits_its_own_blocks_on_recompute():
    h = shared_harness(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    h.add(request("a", tokens(11, 8), max_tokens=20))
    b = h.add(request("b", tokens(12, 8), max_tokens=12))
    while not h.scheduler.num_preemptions:
        h.step()
    assert b.status is RequestStatus.PREEMPTED and b.num_output_tokens > 0
    while b.status is not RequestStatus.RUNNING:
        out = h.schedule()
        h.execute(out)
        if any(r is b for r in out.requests):
            readmitted = out
    hits = readmitted.num_scheduled_tokens[-1]
    assert b.num_computed_tokens - hits > 0, "the recompute started from its cached blocks"
    assert b.num_cached_tokens == 0, "num_cached_tokens is that of the first admission"
    assert h.kv_manager.hits > 0
    h.run()
    h.check_outputs()


def test_caching_changes_no_token_and_saves_work():
    def workload(enable_caching, num_blocks):
        h = Harness(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                    max_num_batched_tokens=24, enable_caching=enable_caching)
        prefixes = [tokens(20 + i, 13) for i in range(3)]
        for i in range(12):
            h.add(request(f"r{i}", prefixes[i % 3][: 5 + i] + tokens(40 + i, i % 5 + 1),
                          max_tokens=3 + (5 * i) % 9))
        h.run()
        h.check_outputs()
        work = sum(o.total_num_scheduled_tokens for o in h.outputs)
        return h, {r.request_id: r.output_token_ids for r in h.requests}, work

    _, want, plain_work = workload(False, 200)
    cached, got, cached_work = workload(True, 200)
    tight, tight_got, _ = workload(True, 12)
    assert got == want == tight_got
    assert cached_work < plain_work and cached.kv_manager.hit_rate > 0.2
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed", range(12))
def test_randomized_soak_with_shared_prefixes(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([32, 64, 100])
    max_num_seqs = rng.randint(1, 6)
    min_blocks = cdiv(max_model_len, block_size) + 1
    h = shared_harness(num_blocks=rng.randint(min_blocks, 3 * min_blocks), block_size=block_size,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=rng.randint(
                           max_num_seqs, 48), max_model_len=max_model_len)
    prefixes = [tokens(100 * seed + i, max_model_len) for i in range(3)]

    def add(i: int) -> None:
        length = rng.randint(1, max_model_len - 1)
        shared = rng.randint(0, length)
        prompt = rng.choice(prefixes)[:shared] + tokens(seed * 1000 + i, length - shared)
        h.add(request(f"s{seed}-{i}", prompt, max_tokens=rng.randint(1, max_model_len - length),
                      repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.1])))

    h.soak(rng, 30, add, bursts=(0, 1, 1, 2, 3), max_steps=20_000)
    assert h.kv_manager.pool.num_free == h.num_blocks - 1
    assert h.kv_manager.hits > 0


# ---- configuration and metrics ------------------------------------------------------------
def test_config_flag_and_cli():
    from jaxserve.cli import build_parser
    from jaxserve.config.engine_args import EngineArgs

    assert CacheConfig().enable_prefix_caching is True
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(enable_prefix_caching="no")
    parser = build_parser()
    for sub in (["generate", "x"], ["serve"]):
        assert EngineArgs.from_cli(parser.parse_args(sub)).enable_prefix_caching is True
        off = parser.parse_args([sub[0], "--no-enable-prefix-caching", *sub[1:]])
        assert EngineArgs.from_cli(off).enable_prefix_caching is False


def test_metrics_export_vllm_prefix_cache_counters():
    pytest.importorskip("prometheus_client")
    from jaxserve.server.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    for totals in ((0, 0), (100, 40), (100, 40), (150, 90)):
        metrics.update_gauges(running=0, waiting=0, kv_usage=0.0, preemptions=0,
                              prefix_cache=totals)
    text = metrics.render().decode()
    assert 'vllm:prefix_cache_queries_total{model_name="m"} 150.0' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 90.0' in text


# ---- end to end on the tiny llama -----------------------------------------------------------
# 64-token budget: prompts over 64 tokens are prefilled in chunks. 48 blocks of 16 tokens
# (47 usable) cannot hold eight ~130-token sequences at once, so the big batch preempts.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=16, num_kv_blocks=48, precompile=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    folder = str(tiny_checkpoints["llama"])
    return (LLM(folder, enable_prefix_caching=True, **ENGINE),
            LLM(folder, enable_prefix_caching=False, **ENGINE))


def ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def shared_prompts(count: int, prefix_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(5, 1024, prefix_len).tolist()
    return [prefix + rng.integers(5, 1024, int(n)).tolist() for n in rng.integers(1, 30, count)]


def test_greedy_tokens_equal_with_and_without_cache(llms):
    cached, plain = llms
    prompts = shared_prompts(6, 70, seed=0)
    before = cached.engine.prefix_cache_stats
    got = cached.generate(prompts, GREEDY, use_tqdm=False)
    assert ids(got) == ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    stats = cached.engine.prefix_cache_stats
    assert stats.hits > before.hits and 0 < stats.hit_rate < 1
    assert plain.engine.prefix_cache_stats.queries == 0
    again = cached.generate(prompts[:1], GREEDY, use_tqdm=False)  # from free cached blocks
    assert ids(again) == ids(got[:1])
    assert 64 <= again[0].num_cached_tokens < len(prompts[0])
    assert cached.engine.kv_manager.usage == 0


def test_preemption_with_shared_prefixes(llms):
    cached, plain = llms
    prompts = shared_prompts(8, 100, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    before, hits = cached.engine.num_preemptions, cached.engine.prefix_cache_stats.hits
    got = cached.generate(prompts, params, use_tqdm=False)
    assert cached.engine.num_preemptions > before
    assert cached.engine.prefix_cache_stats.hits > hits
    assert ids(got) == ids(plain.generate(prompts, params, use_tqdm=False))


def test_excluded_requests_equal_the_uncached_results(llms):
    cached, plain = llms
    prompts = shared_prompts(3, 50, seed=2)
    cached.generate(prompts, GREEDY, use_tqdm=False)  # the prefix is now cached
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             presence_penalty=1.0, frequency_penalty=0.5)]
    before = cached.engine.prefix_cache_stats
    got = cached.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert cached.engine.prefix_cache_stats == before, "excluded requests never read the cache"
    assert ids(got) == ids(want) and all(o.num_cached_tokens == 0 for o in got)
    assert len(got[0].prompt_logprobs) == len(prompts[0])
    for g, w in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert g.keys() == w.keys()
        assert [x.logprob for x in g.values()] == pytest.approx([x.logprob for x in w.values()],
                                                                abs=1e-4)


def test_n_children_share_blocks_and_match_uncached(llms):
    cached, plain = llms
    prompt = shared_prompts(1, 40, seed=3)[0][:40]  # 2 full blocks and 8 tokens
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    engine = cached.engine
    engine.add_request("n3", None, prompt, params)
    engine.step()  # launches the prompt step
    engine.step()  # collects it (and launches the first decode, counted once scheduled)
    children = engine.scheduler.running
    assert [c.num_computed_tokens for c in children] == [41, 41, 41]
    in_use = len({b for c in children for b in held_blocks(c)})
    assert in_use < 3 * cdiv(40, 16) and in_use == 3 + 1 + 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(final_only=True)
    want = plain.generate([prompt], params, use_tqdm=False)
    assert ids(outputs) == ids(want) and len({tuple(t) for t in ids(outputs)[0]}) == 3
