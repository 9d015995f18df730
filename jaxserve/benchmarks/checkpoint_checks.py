"""Greedy decoding margins of the tiny test checkpoints (checkpoints.py), in HF transformers:
parity tests compare greedy tokens on `check_prompts()`, which is only sound where the top
two logits are apart. checkpoints.SEED_OFFSET was picked with greedy_margins; the tests
(test_tiny_checkpoint.py) and `scripts/make_tiny_checkpoint.py --check` check them again.
"""

from __future__ import annotations

import math
import pathlib

from jaxserve.benchmarks.checkpoints import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
)


def check_prompts() -> list[list[int]]:
    """Eight fixed prompts of 3..200 token ids (bos first), independent of the tokenizer."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    lengths = (3, 7, 16, 33, 60, 97, 150, 200)
    return [[BOS_ID] + torch.randint(len(SPECIAL_TOKENS), VOCAB_SIZE, (n - 1,),
                                     generator=gen).tolist()
            for n in lengths]


def load(ckpt):
    """The checkpoint folder's HF model (float32, eval), or ckpt itself if already a model."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if not isinstance(ckpt, (str, pathlib.Path)):
        return ckpt  # already a model
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()


def greedy_margins(ckpt, prompts, new_tokens: int = 40) -> list[dict]:
    """HF greedy generate (eos suppressed by min_new_tokens) on each prompt.

    Per prompt: the generated `tokens`, the smallest top-1 minus top-2 logit `gap`
    over the steps, and the smallest such gap divided by that step's max |logit|
    (`rel_gap`); `max_logit` is the largest |logit| seen.
    """
    import torch

    model = load(ckpt)
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                output_scores=True, return_dict_in_generate=True,
            )
        scores = torch.cat(out.scores)  # f32[steps, V]; eos ids are -inf
        top2 = scores.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        peak = scores.masked_fill(~torch.isfinite(scores), 0).abs().amax(-1)
        results.append(dict(tokens=out.sequences[0, len(prompt):].tolist(),
                            gap=float(gaps.min()), rel_gap=float((gaps / peak).min()),
                            max_logit=float(peak.max())))
    return results


def cache_consistency(ckpt, prompt, new_tokens: int = 40) -> bool:
    """Greedy tokens of generate (with cache) equal those of repeated full forwards."""
    import torch

    model = load(ckpt)
    with torch.no_grad():
        cached = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens)[0, len(prompt):].tolist()
        seq = list(prompt)
        for _ in range(new_tokens):
            logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            logits[[EOS_ID, IM_END_ID]] = -math.inf
            seq.append(int(logits.argmax()))
    return cached == seq[len(prompt):]
