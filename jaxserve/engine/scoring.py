"""Scores of input pairs on a pooling engine, as vLLM's scoring processors make them: the one
place that pairs inputs up, decides what to pool and turns pooled outputs into scores, for
every front end (the server's /score and /rerank; LLM.score can call it the same way).

Pairs follow vLLM's rule: data_1[i] with data_2[i] (N:N), or one data_1 with every data_2
(1:N; 1:1 is both). What runs depends on the engine's pooler:
- an embedding model (bi-encoder): each distinct input is embedded once, and a pair's score
  is the cosine of its two embeddings;
- a classifier with one label (cross-encoder): each pair is tokenized together, as
  tokenizer(text_1, text_2) does, and read by the classification head: the score is its
  sigmoid (its raw logit with use_activation=False). Token-id inputs are refused there (a
  pair's encoding puts the tokenizer's own separators between the two texts).

plan_scores runs the checks before any tokenization (the pooling settings against the
pooler, the pairing, max_embedding_inputs), then tokenizes; ScoreJob.scores makes the
scores from the pooled outputs, in pair order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.core.pooling import normalize
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.engine.outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput

Prompt = tuple  # (text or None, token ids or None)


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    """One scoring request's pooling prompts and how their outputs become scores."""

    cross_encoder: bool
    prompts: list[tuple[str | None, list[int]]]  # what to pool, each once, in this order
    pairs: list[tuple[int, int]]  # per score: the two prompts compared (a cross-encoder: i, i)

    def scores(self, outputs: Sequence[PoolingRequestOutput]) -> list[ScoringRequestOutput]:
        """One ScoringRequestOutput per pair from the outputs of `prompts`, in order."""
        if len(outputs) != len(self.prompts):
            raise ValueError(f"scores need one output per prompt ({len(self.prompts)}), got "
                             f"{len(outputs)}.")
        if self.cross_encoder:
            return [ScoringRequestOutput.from_base(o) for o in outputs]
        scores = []
        for a, b in self.pairs:
            one, two = outputs[a], outputs[b]
            cosine = float(normalize(one.outputs.data) @ normalize(two.outputs.data))
            scores.append(ScoringRequestOutput.from_base(PoolingRequestOutput(
                f"{one.request_id}_{two.request_id}", PoolingOutput(np.float32([cosine])),
                one.prompt_token_ids + two.prompt_token_ids, True,
                num_cached_tokens=one.num_cached_tokens + two.num_cached_tokens)))
        return scores


def pair_indices(count_1: int, count_2: int, fields: tuple[str, str] = ("data_1", "data_2")
                 ) -> list[int]:
    """For each second input, the index of the first input it is scored with (1:1, 1:N or
    N:N); ValueError naming the fields otherwise."""
    first, second = fields
    if count_1 == 0 or count_2 == 0:
        empty = first if count_1 == 0 else second
        raise _error(empty, f"{empty} must not be empty.")
    if count_1 == 1:
        return [0] * count_2
    if count_1 != count_2:
        raise _error(first, f"{first} has {count_1} inputs and {second} {count_2}; give one "
                     f"{first} (scored against each {second}) or as many as {second}.")
    return list(range(count_2))


def plan_scores(processor, data_1: Sequence[Prompt], data_2: Sequence[Prompt],
                params: PoolingParams, fields: tuple[str, str] = ("data_1", "data_2")
                ) -> ScoreJob:
    """The pooling prompts of a scoring request on `processor`'s engine (an
    admission.InputProcessor): data_1 and data_2 as (text or None, token ids or None) items.
    ValueError naming the field for what cannot be scored; the pairs counted against
    max_embedding_inputs before anything is tokenized. params: the request's PoolingParams
    (task "score")."""
    params.clone(task="score").resolve(processor.pooler)  # (a generating engine, 3 labels)
    firsts = pair_indices(len(data_1), len(data_2), fields)
    processor.check_pooling_count(len(data_2), fields[1])
    if processor.pooler.task == "classify":  # a cross-encoder: each pair in one sequence
        prompts = [(None, processor.encode_pair(_text(data_1[i], fields[0]),
                                                _text(b, fields[1])))
                   for i, b in zip(firsts, data_2)]
        return ScoreJob(True, prompts, [(i, i) for i in range(len(prompts))])
    keys = [_key(p, fields[0]) for p in data_1] + [_key(p, fields[1]) for p in data_2]
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}  # each input embedded once
    prompts = [(text, list(ids) if ids is not None else processor.encode(text))
               for text, ids in index]
    pairs = [(index[keys[i]], index[keys[len(data_1) + j]]) for j, i in enumerate(firsts)]
    return ScoreJob(False, prompts, pairs)


def _key(prompt: Prompt, field: str) -> tuple:
    """A (text, token ids) input as a dictionary key, checked."""
    text, ids = prompt
    if ids is None and not isinstance(text, str):
        raise _error(field, f"{field}: each input must be a string or a list of token ids.")
    return text, None if ids is None else tuple(ids)


def _text(prompt: Prompt, field: str) -> str:
    """An input's text; token ids are refused where pairs are tokenized together."""
    text, ids = prompt
    if text is None or ids is not None:
        raise _error(field, f"{field}: a cross-encoder tokenizes each pair together "
                     "(tokenizer(text_1, text_2)): give the inputs as strings.")
    if not isinstance(text, str) or not text:
        raise _error(field, f"{field}: inputs must be non-empty strings.")
    return text


def _error(field: str, message: str) -> ValueError:
    """A refusal naming the request field at fault (err.param, as limit_error's)."""
    err = ValueError(message)
    err.param = field
    return err
