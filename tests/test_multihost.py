"""Multi-host: two processes joined by jax.distributed (CPU, gloo collectives, one device
each) serve one model split over both (--mesh 1x2); host 0 schedules and broadcasts every
step, host 1 follows. The greedy tokens must equal a single process's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from jaxserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "while True:", "import os\nimport sys\n\nclass Config:"]
NEW_TOKENS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# "orbax": the same from a `jaxserve convert` folder, each process restoring only the slices
# of its own device (test_orbax.py covers one process by default).
@pytest.mark.parametrize("source", ["hf", pytest.param("orbax", marks=pytest.mark.slow)])
def test_two_processes_match_one(source, mesh_checkpoints, tmp_path):
    folder = str(mesh_checkpoints["llama"])
    if source == "orbax":
        from jaxserve.backends.jax.orbax_checkpoint import convert

        folder = str(convert(folder, tmp_path / "orbax"))
    engine = ["--model", folder, "--dtype", "float32", "--max-model-len", "128",
              "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--mesh", "1x2"]
    cluster = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-hosts", "2"]
    command = [sys.executable, "-m", "jaxserve.cli", "--log-level", "WARNING", "generate",
               *engine, *cluster, "--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--json",
               *PROMPTS]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    hosts = [subprocess.Popen(command + ["--host-id", str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 0)]
    try:
        results = [host.communicate(timeout=600) for host in hosts]
    finally:
        for host in hosts:
            host.kill()
    for host, (_, err) in zip(hosts, results):
        assert host.returncode == 0, err[-3000:]
    lines = [line for line in results[1][0].splitlines() if line.startswith("{")]
    got = [json.loads(line)["outputs"][0]["token_ids"] for line in lines]
    assert not [line for line in results[0][0].splitlines() if line.startswith("{")]  # host 1

    llm = LLM(folder, dtype="float32", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16, precompile=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
