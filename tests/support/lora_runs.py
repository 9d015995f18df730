"""Greedy generation with LoRA adapters on several meshes, in one process with 8 fake CPU
devices (the device count is fixed when JAX starts: test_lora.py runs this file in a
subprocess):

    python tests/support/lora_runs.py CHECKPOINT ADAPTERS_JSON MESH [MESH ...]

ADAPTERS_JSON: a list of adapter folders. Every prompt of PROMPTS runs with the base model
and with each adapter, all in one generate() call, on an engine with fewer device slots
than adapters (max_loras=2), so adapters wait for slots and are swapped in and out. A second
call repeats the batch with the adapters rotated over the prompts (every adapter loaded
again, into other slots). One JSON line per mesh: the tokens of both calls, in order
(prompt-major: prompt i with the base model, adapter 0, 1, ...), the compilations after
the warm-up (precompile=True), and the LoRA slots' bytes on one device, as allocated and as
`jaxserve plan` counts them.
"""

from __future__ import annotations

import json
import os
import sys

NUM_PROMPTS = 4  # of the tiny checkpoints' check prompts: 3, 7, 16 and 33 tokens
NEW_TOKENS = 10


def prompts() -> list[list[int]]:
    from jaxserve.benchmarks.checkpoint_checks import check_prompts

    return check_prompts()[:NUM_PROMPTS]


def run(folder: str, adapters: list[str], mesh: str, dtype: str = "float32") -> dict:
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.backends.compile_stats import compilation_count

    llm = LLM(folder, dtype=dtype, max_model_len=64, precompile=True, mesh=mesh,
              enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
              max_num_seqs=4, max_num_batched_tokens=16)
    compiled = compilation_count()
    loras = [None] + [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapters)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = [(p, lora) for p in prompts() for lora in loras]
    first = llm.generate([p for p, _ in batch], params, lora_request=[lora for _, lora in batch],
                         use_tqdm=False)
    rotated = [(p, loras[(i + 1 + j) % len(loras)]) for i, p in enumerate(prompts())
               for j in range(len(loras))]
    second = llm.generate([p for p, _ in rotated], params,
                          lora_request=[lora for _, lora in rotated], use_tqdm=False)
    from jaxserve.config.plan import make_plan

    planned = next(g.bytes_per_device for g in make_plan(llm.engine.config, 2**30).weights
                   if g.name == "lora slots")
    return {"mesh": mesh, "tokens": [o.outputs[0].token_ids for o in first],
            "slot_bytes": [llm.engine.runner.loras.device_bytes(), planned],
            "rotated": [[o.outputs[0].token_ids, None if lora is None else lora.lora_int_id]
                        for o, (_, lora) in zip(second, rotated)],
            "compilations": compilation_count() - compiled}


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    paths = json.loads(sys.argv[2])
    for arg in sys.argv[3:]:
        mesh, _, dtype = arg.partition(":")
        print(json.dumps(run(sys.argv[1], paths, mesh, dtype or "float32")), flush=True)
