"""jaxserve: an LLM inference and serving engine on JAX (paged KV cache, continuous batching).

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-model-dir")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

Heavy modules (jax, transformers) load on first use of LLM / LLMEngine, so the host-side
modules (scheduler, block manager, detokenizer) import without jax.
"""

from __future__ import annotations

import logging
import sys

from jaxserve.config import logs
from jaxserve.config.model_path import default_model_path, resolve_model
from jaxserve.config.version import VERSION
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.engine.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from jaxserve.models.lora import LoRARequest

__version__ = VERSION


def _default_logging() -> None:
    """Like vLLM, show jaxserve's INFO lines (KV-cache size, model choice, per-request lines)
    even where nobody configured logging, e.g. in a notebook; the CLI's --log-level and any
    handler the user attaches to the "jaxserve" logger take precedence."""
    logger = logging.getLogger("jaxserve")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(logs.TEXT_FORMAT, logs.TEXT_DATE))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


_default_logging()
logs.quiet_torch_advice()  # the JAX-only install's first screen: no torch advice
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams",
           "PoolingRequestOutput", "EmbeddingRequestOutput", "ClassificationRequestOutput",
           "ScoringRequestOutput", "LoRARequest", "default_model_path", "resolve_model"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from jaxserve.config.engine_config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
