"""jaxserve: an LLM inference and serving engine on JAX (paged KV cache, continuous batching).

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-model-dir")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Heavy modules (jax, transformers) load on first use of LLM / LLMEngine, so the host-side
modules (scheduler, block manager, detokenizer) import without jax.
"""

from __future__ import annotations

from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from jaxserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
