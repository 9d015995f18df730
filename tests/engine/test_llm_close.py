"""LLM.close() and `with LLM(...) as llm:` free the devices and the engine's threads, so that a
second model loads in the same process (a notebook's kernel) and generates what it would
have generated first."""

from __future__ import annotations

import gc
import threading
import weakref

import jax
import pytest
from support.server_helpers import SMALL_ENGINE_ARGS

from jaxserve import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "def main():"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)]
TOLERANCE = 64 << 10  # bytes of arrays jax itself may keep (none were seen)


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def threads() -> set[threading.Thread]:
    # (tqdm's monitor is process-wide, started by the first progress bar, and never stops)
    return {t for t in threading.enumerate() if t.name != "tqdm_monitor"}


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def assert_released(base_bytes: int, base_threads: set) -> None:
    assert live_bytes() - base_bytes <= TOLERANCE
    assert threads() == base_threads, sorted(t.name for t in threads() - base_threads)


def test_two_models_in_sequence_free_memory_and_threads(tiny_checkpoints):
    base_bytes, base_threads = live_bytes(), threads()

    with LLM(**SMALL_ENGINE_ARGS) as first:  # the built-in model
        assert live_bytes() - base_bytes > 1 << 20  # its weights and KV cache
        expected = tokens(first)
        runner = weakref.ref(first.engine.runner)
    assert_released(base_bytes, base_threads)
    assert runner() is None
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        first.generate("Hello")
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        first.chat([{"role": "user", "content": "Hello"}])
    first.close()  # again: nothing to do

    # Another model, its warm-up in a background thread (still compiling when closed: close
    # skips the rest and waits for the compile in progress).
    other = LLM(str(tiny_checkpoints["llama"]), dtype="float32", seed=0,
                precompile="background", **SMALL_ENGINE_ARGS)
    assert any(t.name == "jaxserve-warm-up" for t in threads())
    assert len(tokens(other)) == 2
    other.close()
    assert_released(base_bytes, base_threads)

    # The first model again, loaded after two closed ones: the same tokens as its first run.
    with LLM(**SMALL_ENGINE_ARGS) as again:
        assert tokens(again) == expected
    assert_released(base_bytes, base_threads)


def test_torch_backend_close_frees_its_tensors():
    base_threads = threads()
    llm = LLM(backend="torch", **SMALL_ENGINE_ARGS)
    runner = llm.engine.runner
    watched = [weakref.ref(runner), weakref.ref(runner.kv_caches[0][0]),
               weakref.ref(next(runner.model.parameters()))]
    del runner
    assert len(tokens(llm)) == 2
    llm.close()
    gc.collect()
    assert [ref() for ref in watched] == [None] * len(watched)
    assert threads() == base_threads
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        llm.generate("Hello")
    llm.close()


def test_closing_a_background_warm_up_skips_the_rest_and_ends_its_threads():
    """close() while builds run: those end, the others never start, and the warm-up's
    threads end (a pool's cancelled futures would leave it waiting for ever)."""
    from types import SimpleNamespace

    from jaxserve.backends.jax.bucket_compiler import COMPILE_THREADS, CompiledFunctions

    started, release = [], threading.Event()

    def build(key):
        started.append(key)
        if len(started) > 1:  # (the first one is built before warm_up returns)
            release.wait(30)
        return key

    base = threads()
    buckets = SimpleNamespace(step_buckets=((16, 1), (16, 2), (16, 4), (32, 8), (64, 8)),
                              token_buckets=(16, 32, 64))
    compiled = CompiledFunctions(build, buckets)
    compiled.warm_up(background=True)
    while len(started) < 1 + COMPILE_THREADS:
        threading.Event().wait(0.01)
    compiled.close()
    release.set()
    compiled._warming.join(30)
    assert not compiled._warming.is_alive()
    assert len(started) == 1 + COMPILE_THREADS < len(compiled._warm_up_order())
    for thread in threads() - base:
        thread.join(30)
    assert threads() == base
