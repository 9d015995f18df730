"""A request with more sequences than --max-waiting-requests could never be admitted: it gets a
400 naming its count and the cap (a 429 would have clients retry it forever), while requests
within the cap are served (a full queue's 429: test_async_engine.py)."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient
from support.pooling_refs import POOL_ENGINE

from jaxserve import LLM
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.launch import _warn_unservable_limits

CAP = 2  # --max-waiting-requests


def served(engine):
    """A started AsyncLLMEngine with the small cap, and a TestClient of its app."""
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=CAP)
    async_engine.start()
    server = ServerConfig(served_model_name="tiny", max_waiting_requests=CAP)
    return async_engine, TestClient(create_app(async_engine, server))


def assert_never_admitted(response, count: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    message = error["message"]
    assert f"{count} sequences" in message and f"the {CAP} that may wait" in message, message
    assert "--max-waiting-requests" in message and "never be admitted" in message, message


def test_an_embedding_request_over_the_cap_is_a_400_and_one_within_it_is_served(
        pooling_checkpoints, caplog):
    llm = LLM(str(pooling_checkpoints["qwen3-embed"]), **POOL_ENGINE)  # (its shape: cached)
    async_engine, client = served(llm.engine)
    try:
        # `serve` warns at start-up when max_embedding_inputs (2,048) exceeds the cap
        with caplog.at_level(logging.WARNING, logger="jaxserve.server.launch"):
            _warn_unservable_limits(llm.engine.config, ServerConfig(max_waiting_requests=CAP))
        assert "max_embedding_inputs (2048) is above --max-waiting-requests (2)" in caplog.text
        texts = ["def main():", "import os", "x"]
        assert_never_admitted(client.post("/v1/embeddings", json={"input": texts}), 3)
        response = client.post("/v1/embeddings", json={"input": texts[:CAP]})
        assert response.status_code == 200, response.text
        assert len(response.json()["data"]) == CAP
    finally:
        async_engine.stop()
        llm.close()


def test_a_generation_request_over_the_cap_by_n_is_a_400(tiny_checkpoints):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    async_engine, client = served(LLMEngine(config))
    try:
        body = {"model": "tiny", "prompt": "def", "max_tokens": 2, "n": CAP + 1,
                "temperature": 1.0}
        assert_never_admitted(client.post("/v1/completions", json=body), CAP + 1)
        body = {**body, "prompt": ["def", "x"], "n": 2}  # two prompts x n=2
        assert_never_admitted(client.post("/v1/completions", json=body), 4)
    finally:
        async_engine.stop()
    with pytest.raises(ValueError, match="max_waiting_requests must be >= 1"):
        ServerConfig(max_waiting_requests=0)  # (every request would be refused)
