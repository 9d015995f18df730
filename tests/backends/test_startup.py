"""Start-up: the executable cache on disk, the background warm-up, and compile metrics.

- A second engine loads its compiled steps from the executable cache instead of compiling;
  a corrupt entry, or one written by another jax version, is recompiled with one log line;
  after a source change that keeps the HLO, the entry is found by its HLO.
- Two processes starting at once on one cache folder both start, and a third process runs
  the executables they stored.
- With precompile="background", requests run while the other buckets compile (steps use
  only compiled buckets), and once the warm-up is done a mixed workload compiles nothing.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.backends.compile_stats import compilation_count, executable_loads
from jaxserve.backends.jax.executable_cache import ExecutableCache, versions

# One step bucket (16, 1) and one scoring function: the cheapest engine there is.
ONE_BUCKET = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _entries(folder):
    return sorted((folder / "executables").glob("*.jxc"))


def test_second_engine_loads_instead_of_compiling(tiny_checkpoint, tmp_path, caplog):
    args = dict(ONE_BUCKET, compilation_cache_dir=str(tmp_path), dtype="bfloat16")
    want = LLM(str(tiny_checkpoint), **args).generate("def f(x):", GREEDY, use_tqdm=False)
    entries = _entries(tmp_path)
    assert [e.name.split("-")[0] for e in entries] == ["step"]

    llm = LLM(str(tiny_checkpoint), **args)
    compiles, loads = compilation_count(), executable_loads()
    got = llm.generate("def f(x):", GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert compilation_count() == compiles and executable_loads() == loads + 1

    # Stale: written by another jax version. Then corrupt: a truncated payload. Each is
    # reported once, compiled again, and the entry rewritten so the next start loads it.
    entry = entries[0]
    header, payload = entry.read_bytes().split(b"\n", 1)
    stale = json.loads(header) | {"jax": "0.0.1"}
    for name, content in [("another jax version", json.dumps(stale).encode() + b"\n" + payload),
                          ("corrupt", header + b"\n" + payload[: len(payload) // 3])]:
        entry.write_bytes(content)
        caplog.clear()
        llm = LLM(str(tiny_checkpoint), **args)
        compiles = compilation_count()
        with caplog.at_level(logging.WARNING, logger="jaxserve.backends.jax.executable_cache"):
            got = llm.generate("def f(x):", GREEDY, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, name
        assert compilation_count() > compiles, name
        lines = [r.getMessage() for r in caplog.records if "Executable cache" in r.getMessage()]
        assert len(lines) == 1 and entry.name in lines[0], (name, lines)
        assert entry.read_bytes() != content  # replaced by a good entry


def test_a_source_change_that_keeps_the_hlo_loads_instead_of_compiling(tiny_checkpoint,
                                                                         tmp_path, monkeypatch):
    """The index is keyed by jaxserve's source, the entry by the lowered HLO: after a code
    change that leaves a function's HLO as it was, a start traces and lowers, finds the
    entry, and compiles nothing."""
    from jaxserve.backends.jax import executable_cache

    args = dict(ONE_BUCKET, compilation_cache_dir=str(tmp_path), dtype="float32")
    want = LLM(str(tiny_checkpoint), **args).generate("def f(x):", GREEDY, use_tqdm=False)
    indexes = sorted((tmp_path / "executables").glob("*.idx"))
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "edited source")
    llm = LLM(str(tiny_checkpoint), **args)
    compiles, loads = compilation_count(), executable_loads()
    got = llm.generate("def f(x):", GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert compilation_count() == compiles and executable_loads() == loads + 1
    assert len(_entries(tmp_path)) == 1  # the same entry, now under a second index
    assert len(sorted((tmp_path / "executables").glob("*.idx"))) == len(indexes) + 1


@pytest.mark.slow  # two cold engines: the suite's time budget
def test_models_that_differ_only_in_unread_parameters_get_their_own_entries(tiny_checkpoint,
                                                                             tmp_path):
    """Prompt scoring reads only the embeddings and the head: two models whose other
    parameters differ in shape lower it to the same HLO text, yet each needs its own
    executable (the second start once loaded the first's and failed on its arguments)."""
    import shutil

    folders = []
    for width in (128, 96):
        folder = tmp_path / f"mlp{width}"
        shutil.copytree(tiny_checkpoint, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": width}))
        folders.append(folder)
    args = dict(ONE_BUCKET, compilation_cache_dir=str(tmp_path / "cache"), dtype="float32",
                load_format="dummy")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for folder in folders:
        out = LLM(str(folder), **args).generate("def f(x):", params, use_tqdm=False)
        assert len(out[0].prompt_logprobs) > 1


def test_unusable_entries_never_raise(tmp_path, caplog):
    import jax

    cache = ExecutableCache(tmp_path, {"model": "m"}, jax.devices()[:1])
    index, entry = cache.index_path("step-16-1"), cache.entry_path("step-16-1", "hlo")
    assert cache.load("step-16-1") is None  # absent: no log needed
    assert cache.load_lowered("step-16-1", "hlo") is None and cache.misses == 1
    assert not caplog.records
    bad = [b"", b"\xff\xfe not json\n", b"[1, 2]\n", b'{"format": 1}\n',
           json.dumps({"format": 1, **versions(), "key": entry.stem}).encode()
           + b"\nnot a pickle"]
    for content in bad:
        fresh = ExecutableCache(tmp_path, {"model": "m"}, jax.devices()[:1])
        entry.write_bytes(content)
        assert fresh.load_lowered("step-16-1", "hlo") is None
        index.write_bytes(json.dumps({"key": index.stem, "entry": entry.name}).encode())
        assert fresh.load("step-16-1") is None
        index.write_bytes(content)
        assert fresh.load("step-16-1") is None
    # A key from another configuration never matches this one's index; the same HLO on the
    # same devices is the same entry whatever the configuration.
    other = ExecutableCache(tmp_path, {"model": "other"}, jax.devices()[:1])
    assert other.index_path("step-16-1") != index
    assert other.entry_path("step-16-1", "hlo") == entry
    assert other.entry_path("step-16-1", "other hlo") != entry


_START = textwrap.dedent("""
    import json, sys
    from jaxserve import LLM, SamplingParams
    from jaxserve.backends.compile_stats import compilation_count, executable_loads
    llm = LLM(sys.argv[1], compilation_cache_dir=sys.argv[2], dtype="bfloat16",
              max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16)
    before = compilation_count()
    out = llm.generate("def f(x):", SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    print(json.dumps({"tokens": out[0].outputs[0].token_ids, "loads": executable_loads(),
                      "compiles": compilation_count() - before}))
""")


def _start(checkpoint, folder) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _START, str(checkpoint), str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Slow (two engines compiling at once: the suite's time budget).
@pytest.mark.slow
def test_concurrent_starts_share_the_cache_folder(tiny_checkpoint, tmp_path):
    """Two processes at once on an empty folder both start (each compiles and stores,
    atomically); a third process runs what they stored without compiling."""
    first = [_start(tiny_checkpoint, tmp_path) for _ in range(2)]
    results = []
    for process in first:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["tokens"] == results[1]["tokens"]
    assert not list((tmp_path / "executables").glob(".*"))  # no temporary file left
    third = _start(tiny_checkpoint, tmp_path)
    out, err = third.communicate(timeout=600)
    assert third.returncode == 0, err[-3000:]
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded["tokens"] == results[0]["tokens"]
    assert loaded["loads"] >= 1 and loaded["compiles"] == 0
    assert "Executable cache" not in err


def test_background_warm_up_serves_at_once_and_then_never_compiles(tiny_checkpoint,
                                                                   monkeypatch):
    """Requests run while the warm-up is held back (only the first bucket is compiled, and
    every step fits it); once it finishes, a mixed workload compiles nothing."""
    from jaxserve.backends.jax.runner import ModelRunner

    gate = threading.Event()
    build = ModelRunner._build

    def held_build(self, key):
        if threading.current_thread().name.startswith(("jaxserve-warm-up", "jaxserve-compile")):
            gate.wait(120)  # the background warm-up waits; the engine thread never does
        return build(self, key)

    monkeypatch.setattr(ModelRunner, "_build", held_build)
    llm = LLM(str(tiny_checkpoint), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, precompile="background")
    engine = llm.engine
    assert not engine.warm_up_done
    assert engine.runner.step_limits() == (16, 4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 1000, n).tolist() for n in (3, 30, 17, 9, 40, 2)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert not engine.warm_up_done  # all of that ran during the warm-up
    assert engine.runner.padding.token_slots == 16 * engine.runner.padding.steps

    gate.set()
    engine.runner.compiled._warming.join(300)
    assert engine.warm_up_done and engine.runner.step_limits() is None
    before = compilation_count()
    mixed = [SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice(
        [0, 5])), max_tokens=int(rng.integers(1, 20)), logprobs=2 if i % 3 == 0 else None,
        prompt_logprobs=1 if i % 7 == 0 else None, n=int(rng.choice([1, 2])), seed=i)
        for i in range(50)]
    prompts = [rng.integers(5, 1000, int(n)).tolist() for n in rng.integers(1, 90, 50)]
    outs = llm.generate(prompts, mixed, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert compilation_count() == before
    # Same greedy text as a plainly compiled engine (the padding to (16, 4) changes nothing).
    plain = LLM(str(tiny_checkpoint), dtype="float32", max_model_len=128, max_num_seqs=4,
                max_num_batched_tokens=32)
    again = plain.generate(prompts[:4], params, use_tqdm=False)
    first = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_compile_on_first_use_picks_the_smallest_bucket(tiny_checkpoint):
    """Without a background warm-up, a decode step after a long prefill compiles and runs
    its own small bucket instead of padding up to the prefill's (every later step would pay
    for the padding)."""
    llm = LLM(str(tiny_checkpoint), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, compilation_cache_dir=None)
    llm.generate([list(range(5, 45))], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    runner = llm.engine.runner
    assert {k for k in runner.compiled.ready() if k[0] == "step"} == {("step", 64, 4),
                                                                 ("step", 16, 1)}
    assert runner.padding.token_slots == 64 + 3 * 16
