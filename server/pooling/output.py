"""Pooling outputs -> vLLM's response objects: EmbeddingResponse, PoolingResponse,
ClassificationResponse, ScoreResponse and RerankResponse, and vectors as JSON floats or as
base64 (the raw bytes of embed_dtype in the asked byte order; float32 little-endian is what
the official `openai` client sends by default and decodes with numpy).

Runs on the encoding threads: a response can hold thousands of vectors, and each is dumped
to JSON on its own (one json.dumps call holds the GIL from start to end).
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np

from jaxserve.engine.outputs import PoolingRequestOutput, ScoringRequestOutput


def supported_tasks(pooler) -> list[str]:
    """What the served model does (the /v1/models cards' `tasks`, a jaxserve extension), in
    vLLM's task names: "generate", or its pooling tasks ("encode" is /pooling)."""
    if pooler is None:
        return ["generate"]
    tasks = [pooler.task]
    if pooler.task == "embed" or pooler.num_labels == 1:  # bi-encoder / cross-encoder
        tasks.append("score")
    return [*tasks, "encode"]


def encode_vector(data: np.ndarray, encoding_format: str = "float",
                  embed_dtype: str = "float32", endianness: str = "native") -> list | str:
    """A vector as JSON floats, or as base64 of its embed_dtype values in `endianness`
    ("native": this machine's) byte order."""
    data = np.asarray(data, np.float32)
    if encoding_format == "float":
        return data.tolist()
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    if embed_dtype == "bfloat16":  # float32's top half, rounded to nearest even
        bits = data.view(np.uint32).astype(np.uint64)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        raw = values.astype(np.dtype(np.uint16).newbyteorder(order)).tobytes()
    else:
        raw = data.astype(np.dtype(embed_dtype).newbyteorder(order)).tobytes()
    return base64.b64encode(raw).decode("ascii")


def usage(outputs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}


def _listing(request_id: str, model: str, data: list[dict], outputs) -> dict:
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage(outputs)}


def vectors_response(request_id: str, model: str, outputs: list[PoolingRequestOutput],
                     body, kind: str = "embedding") -> dict:
    """An EmbeddingResponse (kind "embedding") or PoolingResponse (kind "pooling"): each
    output's vector, encoded as the body asks (encoding_format, embed_dtype, endianness)."""
    key = "embedding" if kind == "embedding" else "data"
    data = [{"index": i, "object": kind,
             key: encode_vector(o.outputs.data, body.encoding_format, body.embed_dtype,
                                body.endianness)}
            for i, o in enumerate(outputs)]
    return _listing(request_id, model, data, outputs)


def classification_response(request_id: str, model: str, outputs: list[PoolingRequestOutput],
                            labels: tuple[str, ...]) -> dict:
    """vLLM's ClassificationResponse: per input the probabilities (the logits with
    use_activation=false), the likeliest label (id2label's name) and the label count."""
    data = []
    for i, output in enumerate(outputs):
        probs = np.asarray(output.outputs.data, np.float32)
        best = int(probs.argmax())
        data.append({"index": i, "label": labels[best] if best < len(labels) else None,
                     "probs": probs.tolist(), "num_classes": int(probs.size)})
    return _listing(request_id, model, data, outputs)


def score_response(request_id: str, model: str, scores: list[ScoringRequestOutput]) -> dict:
    data = [{"index": i, "object": "score", "score": s.outputs.score}
            for i, s in enumerate(scores)]
    return _listing(request_id, model, data, scores)


def rerank_response(request_id: str, model: str, scores: list[ScoringRequestOutput],
                    documents: list[str], top_n: int, return_documents: bool) -> dict:
    """vLLM's RerankResponse: the documents by relevance, highest first (ties in document
    order), the first top_n of them (0: all)."""
    results = []
    for i, score in enumerate(scores):
        result = {"index": i, "relevance_score": score.outputs.score}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    results.sort(key=lambda r: -r["relevance_score"])
    if 0 < top_n < len(results):
        results = results[:top_n]
    tokens = usage(scores)["prompt_tokens"]
    return {"id": request_id, "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def json_bytes(response: dict) -> bytes:
    """The response as compact JSON, its `data` / `results` items dumped one at a time."""
    parts = []
    for key, value in response.items():
        if key in ("data", "results") and isinstance(value, list):
            text = "[" + ",".join(_dumps(item) for item in value) + "]"
        else:
            text = _dumps(value)
        parts.append(json.dumps(key) + ":" + text)
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
