"""Greedy generation on several meshes in one process with 8 fake CPU devices.

test_mesh.py runs this file in a subprocess (the device count is fixed when JAX starts):
    python tests/support/mesh_runs.py CHECKPOINT MESH [MESH ...]
(MESH like 2x4, 1x8:ep for expert parallelism, 1x4:int8 for int8 weights, 1x8:ep,int8,
1x4:fp8kv or 1x4:int8kv for a quantized KV cache, 1x4:lp to also report the top 5 logprobs
at each generated position; MESH@FOLDER runs another checkpoint) and reads one JSON line per
mesh: the greedy token ids of every prompt (the tiny checkpoints' check prompts), and per
data-parallel replica the requests routed to it and the device steps it ran.
"""

from __future__ import annotations

import json
import os
import sys

NUM_PROMPTS = 4  # of the tiny checkpoints' check prompts: 3, 7, 16 and 33 tokens
NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    from jaxserve.benchmarks.checkpoint_checks import check_prompts

    return check_prompts()[:NUM_PROMPTS]


def run(folder: str, mesh: str) -> dict:
    from jaxserve import LLM, SamplingParams

    shape, _, options = mesh.partition(":")
    options = options.split(",")
    llm = LLM(folder, dtype="float32", max_model_len=64, precompile=False, mesh=shape,
              expert_parallel="ep" in options, max_num_seqs=2, max_num_batched_tokens=16,
              quantization="int8" if "int8" in options else None,
              kv_cache_dtype=next((o[:-2] for o in options if o.endswith("kv")), "auto"))
    replicas = getattr(llm.engine, "replicas", [llm.engine])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=5 if "lp" in options else None)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    logprobs = [[{token: lp.logprob for token, lp in top.items()} for top in o.outputs[0].logprobs]
                for o in outputs] if "lp" in options else None
    return {"mesh": mesh, "tokens": [o.outputs[0].token_ids for o in outputs], "logprobs": logprobs,
            "routed": getattr(llm.engine, "routed", [NUM_PROMPTS]), "steps": [r.runner.padding.steps for r in replicas],
            "devices": [[d.id for d in r.runner.mesh.devices.flat] for r in replicas],
            "cache_dtype": str(replicas[0].runner.cache_dtype)}


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # before JAX starts
    os.environ["JAX_PLATFORMS"] = "cpu"
    for arg in sys.argv[2:]:
        mesh, _, folder = arg.partition("@")
        print(json.dumps({**run(folder or sys.argv[1], mesh), "mesh": arg}), flush=True)
