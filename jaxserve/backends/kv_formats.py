"""The quantized KV cache's formats, scale rule and calibration text (no jax, no torch).

kv_cache_dtype fp8 (= fp8_e4m3) or int8 stores one byte per element, x ~= stored * scale,
with a float32 scale per layer and kv head for keys and another for values; both backends
(jax/kv_quant.py and torch/kv_quant.py) quantize, attend and calibrate by the
rules here, so their caches hold the same values.

The scales are calibrated once at start-up, as vLLM's calculate_kv_scales does from a first
batch: the model runs over CALIBRATION_TEXT (prose, code, numbers, a chat turn, JSON, SQL)
and records each layer's largest |k| and |v| per kv head; scale = largest * HEADROOM /
the format's LARGEST value. fp8 (a float: ~2 significant digits at any magnitude) gets room
for values 4x beyond the calibration's; int8 (uniform steps) 25%, and larger values
saturate. Per-channel int8 scales were tried and dropped: on prompts unlike the calibration
text (random token ids) channels that were quiet in calibration saturated, and greedy
agreement fell (69% -> 49% on the small benchmark model; scripts/eval_quantization.py).
"""

from __future__ import annotations

import numpy as np

from jaxserve.config.kv_sizing import cache_element

LARGEST = {"fp8_e4m3": 448.0, "int8": 127.0}  # the format's largest finite value
HEADROOM = {"fp8_e4m3": 4.0, "int8": 1.25}
MIN_AMAX = 1e-6  # a kv head that was all zeros during calibration still gets a usable scale
CALIBRATION_TOKENS = 512  # at most; fewer when max_model_len is shorter

CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg \
combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, \
presses in more than two hundred cities had printed some twenty million volumes, and the \
price of a book fell so far that students could own one.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Merge overlapping [start, end] intervals.\"\"\"
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

User: What is 17 * 23, and is the result prime?
Assistant: 17 * 23 = 391. It is not prime: 391 = 17 x 23, so its only divisors are 1, 17, \
23 and 391.

Quarterly revenue rose 4.7% to $12.31 billion (Q3 2024: $11.76 billion); operating margin \
was 18.2%, versus 17.9% a year earlier. 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233.
Les données sont stockées dans un cache paginé; die Schlüssel werden pro Kopf skaliert.
{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius", "days": 3}}
SELECT user_id, COUNT(*) AS orders FROM orders WHERE created_at >= '2024-01-01' GROUP BY 1;
"""


def is_quantized(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype != "auto"


def scales_from_amax(amax: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """f32[..., K] scales from the largest |x| per kv head seen in calibration
    (amax f32[..., K])."""
    element = cache_element("", kv_cache_dtype)
    amax = np.maximum(np.asarray(amax, np.float32), MIN_AMAX)
    return (amax * (HEADROOM[element] / LARGEST[element])).astype(np.float32)


def largest(dtype_name: str) -> float:
    """The largest value a one-byte cache dtype holds (by name: "int8", "float8_e4m3fn")."""
    return LARGEST["int8" if dtype_name == "int8" else "fp8_e4m3"]


def calibration_token_ids(tokenizer, vocab_size: int, max_model_len: int) -> np.ndarray:
    """i32[T]: CALIBRATION_TEXT as the model's prompts start (with the tokenizer's special
    tokens), at most CALIBRATION_TOKENS and max_model_len; ids past the model's vocabulary
    (a tokenizer larger than the embeddings) are dropped."""
    from jaxserve.inputs.tokenizer import with_special_tokens

    ids = with_special_tokens(tokenizer, tokenizer.encode(CALIBRATION_TEXT,
                                                          add_special_tokens=False))
    ids = [i for i in ids if 0 <= i < vocab_size][:min(CALIBRATION_TOKENS, max_model_len)]
    if len(ids) < 2:
        raise ValueError("The tokenizer turned the KV-cache calibration text into fewer than "
                         "2 tokens of the model's vocabulary; use kv_cache_dtype='auto'.")
    return np.asarray(ids, np.int32)
