"""What the pooling tests compare with, shared by test_pooling.py, test_pooling_api.py and
test_bench_scripts.py: the engine shape their pooling engines share (its compiled steps
served to all of them by the executable cache), Hugging Face transformers' hidden states and
classifier probabilities of one unpadded sequence, and random prompts."""

from __future__ import annotations

import functools

import numpy as np

POOL_ENGINE = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
                   max_model_len=128, num_gpu_blocks_override=10, attention_backend="reference",
                   seed=0)
COSINE_F32 = 1e-5


@functools.lru_cache(maxsize=None)
def _hf(folder: str, classifier: bool, dtype: str = "float32"):
    import torch
    import transformers

    cls = (transformers.AutoModelForSequenceClassification if classifier
           else transformers.AutoModel)
    return cls.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


def hf_hidden(folder, ids: list[int]) -> np.ndarray:
    """f32[L, D]: transformers' last_hidden_state of one unpadded sequence."""
    import torch

    with torch.no_grad():
        out = _hf(str(folder), False)(torch.tensor([ids]))
    return out.last_hidden_state[0].float().numpy()


def hf_probs(folder, ids: list[int] | dict, activation: bool = True,
             dtype: str = "float32") -> np.ndarray:
    """transformers' sequence-classification logits of one unpadded sequence (or a pair's
    encoding), through sigmoid (one label) or softmax."""
    import torch

    inputs = ids if isinstance(ids, dict) else {"input_ids": torch.tensor([ids])}
    with torch.no_grad():
        logits = _hf(str(folder), True, dtype)(**inputs).logits[0].float()
    if not activation:
        return logits.numpy()
    return (torch.sigmoid(logits) if logits.shape[0] == 1 else torch.softmax(logits, -1)).numpy()


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def cosine_distance(a, b) -> float:
    return 1.0 - float(unit(a) @ unit(b))


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)  # ids >= 5: no special token (pad is 4)
    return [rng.integers(5, 1024, n).tolist() for n in lengths]
