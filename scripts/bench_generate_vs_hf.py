"""Side-by-side: `jaxserve generate` on both backends vs HF transformers `generate`.

    python scripts/bench_generate_vs_hf.py --model DIR [--num-prompts 64] [--max-tokens 64]
                                           [--backends jax,torch]

jaxserve runs twice per backend (JAX; torch, the PyTorch/Triton backend): as a user runs it
(the CLI in a subprocess, start-up and compilation included), and in this process with the
engine already built (the generation phase alone).
HF runs in this process with static batches of --hf-batch-size, left padding, greedy, on 1
and on 2 torch threads (the best is compared). Every run generates exactly --max-tokens per
prompt (EOS ignored). Prints one table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import sysconfig
import tempfile
import time


def make_prompts(count: int) -> list[str]:
    """Deterministic prompts: the first lines of standard-library functions."""
    lines = []
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for line in path.read_text(errors="ignore").splitlines():
            if line.startswith("def ") and 12 < len(line) < 100:
                lines.append(line)
                break
        if len(lines) == count:
            return lines
    raise RuntimeError("not enough prompts in the standard library")


def run_jaxserve(model: str, prompts: list[str], max_tokens: int, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(prompts) + "\n")
    cmd = [str(pathlib.Path(sys.executable).parent / "jaxserve"), "generate", "--model", model,
           "--prompts-file", f.name, "--max-tokens", str(max_tokens), "--ignore-eos", "--json",
           "--dtype", "float32", *extra]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    results = [json.loads(line) for line in out.stdout.splitlines()]
    tokens = sum(len(r["outputs"][0]["token_ids"]) for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def run_jaxserve_in_process(model: str, prompts: list[str], max_tokens: int,
                            backend: str) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", backend=backend)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # first-call overheads out of the way
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def run_hf(model: str, prompts: list[str], max_tokens: int, batch_size: int,
           threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i:i + batch_size], return_tensors="pt", padding=True)
            out = hf.generate(**enc, do_sample=False, max_new_tokens=max_tokens,
                              pad_token_id=pad)
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--jaxserve-args", default="", help="extra CLI flags, one string")
    parser.add_argument("--backends", default="jax,torch", help="jaxserve backends to run")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts)
    backends = args.backends.split(",")
    rows = [(f"jaxserve {backend} (CLI, wall)",
             run_jaxserve(args.model, prompts, args.max_tokens,
                          args.jaxserve_args.split() + ["--backend", backend]))
            for backend in backends]
    rows += [(f"jaxserve {backend} LLM (warm)",
              run_jaxserve_in_process(args.model, prompts, args.max_tokens, backend))
             for backend in backends]
    for threads in (1, 2):
        rows.append((f"HF generate b={args.hf_batch_size} t={threads}",
                     run_hf(args.model, prompts, args.max_tokens, args.hf_batch_size, threads)))
    best_hf = max(r["output_tok_s"] for name, r in rows if name.startswith("HF"))
    print(f"{'':32}{'wall s':>10}{'out tokens':>12}{'out tok/s':>12}{'vs best HF':>12}")
    for name, r in rows:
        print(f"{name:32}{r['wall_s']:10.2f}{r['output_tokens']:12d}{r['output_tok_s']:12.1f}"
              f"{r['output_tok_s'] / best_hf:12.2f}")


if __name__ == "__main__":
    main()
