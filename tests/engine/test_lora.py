"""Multi-LoRA serving offline: greedy tokens with PEFT adapters equal transformers + PEFT's,
with adapters and the base model mixed in one generate() call, on meshes 1x1 and 1x2, with
fewer device slots than adapters (swaps) and no compilation after the warm-up; the slots'
scheduling; prefix caching keyed by the adapter; the refusals."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from support.lora_helpers import greedy, make_adapter, peft_models
from support.lora_runs import NEW_TOKENS, prompts

from jaxserve.core.lora_slots import LoraSlots
from jaxserve.models.lora import LoRARequest

# (rank, target modules, rsLoRA): all seven projections; two; three with rsLoRA scaling
ADAPTERS = ((8, None, False), (4, ("q_proj", "v_proj"), False),
            (16, ("o_proj", "down_proj", "gate_proj"), True))


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> list[pathlib.Path]:
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i, (rank, modules, rslora) in enumerate(ADAPTERS):
        extra = {} if modules is None else {"target_modules": modules}
        out.append(make_adapter(tiny_checkpoints["llama"], root / f"adapter{i}", seed=i + 1,
                                rank=rank, use_rslora=rslora, **extra))
    return out


@pytest.fixture(scope="module")
def references(tiny_checkpoints, adapters) -> dict:
    """(prompt index, 0 for the base model or adapter id) -> (tokens, logprobs)."""
    models = peft_models(tiny_checkpoints["llama"], adapters)
    return {(i, k): greedy(model, p, NEW_TOKENS)
            for i, p in enumerate(prompts()) for k, model in enumerate(models)}


def test_mixed_adapters_equal_peft_on_meshes_without_compiling(tiny_checkpoints, adapters,
                                                                references):
    script = pathlib.Path(__file__).parents[1] / "support" / "lora_runs.py"
    run = subprocess.run([sys.executable, str(script), str(tiny_checkpoints["llama"]),
                          json.dumps([str(a) for a in adapters]), "1x1", "1x2",
                          "1x1:bfloat16"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["mesh"] for r in results] == ["1x1", "1x2", "1x1"]
    kinds = len(adapters) + 1
    for result in results[:2]:  # float32: token for token
        assert result["compilations"] == 0, result  # loads and swaps compile nothing
        allocated, planned = result["slot_bytes"]
        assert allocated == planned > 0, result["mesh"]
        for j, tokens in enumerate(result["tokens"]):
            assert tokens == references[j // kinds, j % kinds][0], (result["mesh"], j)
        for j, (tokens, lora_id) in enumerate(result["rotated"]):
            assert tokens == references[j // kinds, lora_id or 0][0], (result["mesh"], j)
    # The adapters change the model's greedy tokens (nonzero B matrices).
    base = [references[i, 0][0] for i in range(len(prompts()))]
    for k in range(1, kinds):
        assert [references[i, k][0] for i in range(len(prompts()))] != base
    # bfloat16: each token the engine chose is near the best under float32 PEFT (within
    # the rounding of a bf16 forward pass, which moves this tiny model's logprobs by up to
    # ~0.3 with or without an adapter), and most are the best.
    bf16 = results[2]
    assert bf16["compilations"] == 0
    exact = total = 0
    for j, tokens in enumerate(bf16["tokens"]):
        reference, logprobs = references[j // kinds, j % kinds]
        for position, (token, lp) in enumerate(zip(tokens, logprobs)):
            if tokens[:position] != reference[:position]:
                break  # past a divergence the float32 positions no longer apply
            assert lp.max() - lp[token] < 0.5, (j, position)
            exact += token == reference[position]
            total += 1
    assert exact >= 0.8 * total, (exact, total)


def test_slots_are_shared_reused_and_given_back():
    a, b, c = (LoRARequest(n, i + 1, f"/x/{n}") for i, n in enumerate("abc"))
    slots = LoraSlots(2)
    assert slots.acquire(None) == -1 and slots.can_admit(None)
    sa = slots.acquire(a)
    assert slots.acquire(a) == sa  # the adapter's running requests share its slot
    sb = slots.acquire(b)
    assert sb != sa and not slots.can_admit(c)  # both slots in use: c waits
    assert slots.can_admit(a) and slots.running_names() == ("a", "b")
    slots.release(sb)
    assert slots.can_admit(c) and slots.holds[sb] == b  # idle, still holding b
    assert slots.acquire(b) == sb  # b comes back to its slot: no load
    slots.release(sb)
    slots.release(sa)
    slots.release(sa)
    assert slots.acquire(c) == sb  # b's slot has been idle longest
    assert slots.holds[sa] == a and slots.holds[sb] == c


def test_scheduler_runs_at_most_max_loras_adapters_and_lets_the_base_model_pass():
    from support.scheduler_harness import make_request

    from jaxserve.config.engine_config import SchedulerConfig
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.core.scheduler import Scheduler

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    scheduler = Scheduler(config, KVCacheManager(64, 16), lora_slots=LoraSlots(1))
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    requests = [make_request(f"r{i}", 8, 4) for i in range(4)]
    for request, lora in zip(requests, (a, b, None, a)):
        request.lora = lora
        scheduler.add(request)
    out = scheduler.schedule()
    # b waits for the one slot; the base-model request and a's second request go past it
    assert [r.request_id for r in out.requests] == ["r0", "r2", "r3"]
    assert [r.lora_slot for r in out.requests] == [0, -1, 0]
    assert scheduler.lora_stats() == dict(lora_running=("a",), lora_waiting=("b",),
                                          max_loras=1)
    for request in (requests[0], requests[3]):
        scheduler.finish(request, request.status.FINISHED_ABORTED)
    assert scheduler.lora_slots.users == [0]
    out = scheduler.schedule()
    assert requests[1] in out.requests and requests[1].lora_slot == 0


def test_prefix_cache_is_keyed_by_the_adapter(tiny_checkpoints, adapters):
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=128, enable_lora=True,
              max_lora_rank=16, max_num_seqs=4)
    lora = LoRARequest("adapter0", 1, str(adapters[0]))
    prompt = prompts()[3]  # 33 tokens: two full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cached = lambda **kw: llm.generate([prompt], params, use_tqdm=False, **kw)[0] \
        .num_cached_tokens
    assert llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0] \
        .lora_request == lora  # (an output names its adapter, as vLLM's)
    llm.reset_prefix_cache()
    assert cached() == 0
    assert cached(lora_request=lora) == 0  # the base model's blocks are not the adapter's
    assert cached(lora_request=lora) == 32
    assert cached() == 32
    # `jaxserve plan` counts the slots' bytes as the runner allocates them.
    from jaxserve.config.plan import make_plan

    plan = make_plan(llm.engine.config, 2**30)
    slots = next(g for g in plan.weights if g.name == "lora slots")
    assert slots.bytes_per_device == llm.engine.runner.loras.device_bytes() > 0
    llm.close()


def test_refusals_name_the_problem(tiny_checkpoints, adapters, tmp_path):
    from jaxserve import LLM, SamplingParams

    base = str(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=2)
    lora = LoRARequest("adapter0", 1, str(adapters[0]))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(base, max_loras=2)
    with pytest.raises(ValueError, match="JAX backend only"):
        LLM(base, enable_lora=True, backend="torch")
    with pytest.raises(ValueError, match="max_lora_rank must be at most 512"):
        LLM(base, enable_lora=True, max_lora_rank=1024)
    off = LLM(base, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="LoRA adapters are off"):
        off.generate("x", params, lora_request=lora, use_tqdm=False)
    off.close()
    llm = LLM(base, max_model_len=64, max_num_seqs=2, enable_lora=True, max_lora_rank=4)
    cases = {
        "rank": (lora, "max_lora_rank"),  # rank 8 > 4
        "folder": (LoRARequest("gone", 2, str(tmp_path / "missing")), "missing"),
        "count": ([lora, None, lora], "3 entries for 1 prompts"),
    }
    for request, message in cases.values():
        with pytest.raises(ValueError, match=message):
            llm.generate("x", params, lora_request=request, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/x")
    # A refused request leaves the engine as it was: the next one runs.
    assert llm.generate("x", params, use_tqdm=False)[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()
    llm.close()
