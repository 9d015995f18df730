"""What the front ends read of the engine behind AsyncLLMEngine, as vLLM's AsyncLLM exposes
its processor, tokenizer and model config: the admission path (engine/admission.py's
InputProcessor), the tokenizer, the config and the model's limits. The HTTP routes, the
OpenAI, Responses and pooling front ends and gRPC read these, never the engine object (a
test scans server/ for reaches past them: tests/project/test_front_end_reaches.py).

All are fixed when the engine is made, so any thread may read them; every engine kind the
server runs on (engine/interface.py's EngineInterface: LLMEngine, DataParallelEngine,
EngineCoreClient) has them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.config.engine_config import EngineConfig, ModelConfig
    from jaxserve.engine.admission import InputProcessor
    from jaxserve.engine.interface import EngineInterface


class EngineView:
    """AsyncLLMEngine's part: reads of self.engine (see the module's docstring)."""

    engine: EngineInterface

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model

    @property
    def processor(self) -> InputProcessor:
        """The admission path (engine/admission.py): thread-safe, run off the event loop."""
        return self.engine.processor

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.vocab_size

    @property
    def sampling_defaults(self) -> dict:
        """The model folder's generation defaults (generation_config.json), as requests
        start from them."""
        return self.engine.config.model.sampling_defaults
