"""One adapter's values reach only its own requests (vLLM's behaviour): an adapter with a NaN
or infinite weight is refused at admission naming the tensor, and one whose finite weights
overflow in the step (admitted: nothing in its file is wrong) spoils its own tokens alone:
the base model's and the other adapters' requests in the same steps, and every request
after it (its slot keeps its weights; its KV blocks are reused), get the tokens and
logprobs they get without it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.lora_helpers import make_adapter, poison_adapter
from support.lora_runs import prompts

from jaxserve.models.lora import LoRARequest, inspect_adapter, load_adapter

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def folders(tiny_checkpoints, tmp_path_factory) -> dict:
    base = tiny_checkpoints["llama"]
    root = tmp_path_factory.mktemp("isolation")
    good = {f"good{i}": make_adapter(base, root / f"good{i}", seed=i + 1, rank=4 + 4 * i)
            for i in range(3)}
    nan, nan_tensor = poison_adapter(good["good0"], root / "nan", float("nan"))
    # Every value of one lora_A near float32's largest: finite, so admitted, but x . A
    # overflows to inf for every token of the step, through every slot.
    overflow, _ = poison_adapter(good["good1"], root / "overflow", 3e38, whole=True)
    return {**good, "nan": nan, "nan_tensor": nan_tensor, "overflow": overflow}


def test_non_finite_weights_are_refused_naming_the_adapter_and_tensor(tiny_checkpoints,
                                                                      folders, tmp_path):
    from jaxserve import LLM, SamplingParams

    hf = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    inspect_adapter(folders["nan"], hf, 16)  # the header alone is fine
    with pytest.raises(ValueError, match=f"{folders['nan_tensor']}.*non-finite"):
        inspect_adapter(folders["nan"], hf, 16, values=True)
    with pytest.raises(ValueError, match=f"{folders['nan_tensor']}.*non-finite"):
        load_adapter(folders["nan"], hf, 16)
    # Finite in the file, infinite once in the slots' dtype: refused where it is loaded.
    big, name = poison_adapter(folders["good0"], tmp_path / "big", 1e5)
    inspect_adapter(big, hf, 16, values=True)
    assert np.isfinite(load_adapter(big, hf, 16)[("layers", 0, "attn", "wq")][0]).all()
    with pytest.raises(ValueError, match=f"{name}.*in float16"):
        load_adapter(big, hf, 16, dtype=np.float16)

    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64, max_num_seqs=2,
              enable_lora=True, max_lora_rank=16)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=f"'nan'.*{folders['nan_tensor']}.*non-finite"):
        llm.generate("x", params, lora_request=LoRARequest("nan", 9, str(folders["nan"])),
                     use_tqdm=False)
    assert llm.generate("x", params, use_tqdm=False)[0].outputs[0].token_ids
    llm.close()


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_an_overflowing_adapter_spoils_only_its_own_requests(tiny_checkpoints, folders, dtype):
    from jaxserve import LLM, SamplingParams

    # No prefix cache and few blocks: every run reuses the blocks of the one before.
    llm = LLM(str(tiny_checkpoints["llama"]), dtype=dtype, max_model_len=64, max_num_seqs=8,
              enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=4,
              enable_prefix_caching=False, num_gpu_blocks_override=32)
    adapter = {name: LoRARequest(name, i + 1, str(folders[name]))
               for i, name in enumerate(("good0", "good1", "good2", "overflow"))}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=3)
    chosen = prompts()[1:3]

    def run(last: str) -> list:
        """Each prompt with the base model, good0, good1 and `last`, in the same steps."""
        loras = [None, adapter["good0"], adapter["good1"], adapter[last]]
        batch = [(p, lora) for p in chosen for lora in loras]
        outputs = llm.generate([p for p, _ in batch], params, use_tqdm=False,
                               lora_request=[lora for _, lora in batch])
        return [(o.outputs[0].token_ids,
                 [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
                for o in outputs]

    before = run("good2")
    spoiled = run("overflow")
    after = run("good2")
    for k, (ref, got, later) in enumerate(zip(before, spoiled, after)):
        if k % 4 == 3:  # the overflowing adapter's own requests (and good2's in the others)
            assert ref == later, k
            continue
        assert got == ref, (k, got, ref)  # same steps' shapes: the same values, exactly
        assert later == ref, k
        assert all(np.isfinite(list(step.values())).all() for step in got[1]), k
    assert before[0][0] != before[1][0]  # (an adapter changes the tokens)
    llm.close()
