"""vLLM's gRPC GenerateRequest in, jaxserve's SamplingParams out; RequestOutputs back to the
proto's GenerateStreamChunk / GenerateComplete.

Follows the servicer the SMG gateway drives vLLM through, field by field, so a router or
client written for vLLM's gRPC engine reads the same answers:
- proto3 defaults: temperature unset means 1.0, top_p 0 means 1.0, repetition_penalty 0
  means 1.0, n 0 means 1, top_k 0 and min_p 0 mean disabled, max_tokens unset means up to
  max_model_len. Booleans are taken as sent (the gateway always sets skip_special_tokens and
  spaces_between_special_tokens). The model's generation-config defaults are not applied
  here: GetModelInfo reports them and the gateway applies them, as with vLLM.
- Streamed chunks carry the new tokens only (token_ids, completion_tokens and
  output_logprobs of this chunk), prompt_tokens and cached_tokens each time. A choice that
  ends is followed by its GenerateComplete, which carries all of that choice's tokens and
  their logprobs (as the complete of a non-streamed request does).
- The prompt logprobs (input_logprobs) go out once per request, as they are the same for
  every choice: streamed, in the first chunk that can carry them (normally the first
  choice's first chunk); unstreamed, in choice 0's GenerateComplete. Sent with each choice
  they were n copies (n=16 and a 1,000-token prompt: 2.2 MiB).
- finish_reason is "stop", "length" or "abort"; matched_token_id is the stop token id,
  matched_stop_str the stop string (neither for EOS).

Embed (a pooling model's embedding of one tokenized input; vLLM's servicer leaves it
unimplemented): the input through the same admission path as /v1/embeddings
(InputProcessor.process_pooling), refused with NotPooling (FAILED_PRECONDITION) on a model
that does not embed.

Fields jaxserve cannot honour (multimodal inputs, KV transfer for prefill/decode
disaggregation, a data-parallel rank other than 0, structural tags, logprobs of the whole
vocabulary) are refused with INVALID_ARGUMENT naming them, never ignored.
"""

from __future__ import annotations

import dataclasses
import math

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.engine.outputs import CompletionOutput, RequestOutput

UNSET_ONE = ("top_p", "repetition_penalty")  # 0 (proto3's unset) means 1.0


class BadRequest(ValueError):
    """A request field jaxserve refuses (INVALID_ARGUMENT); the message names it."""


@dataclasses.dataclass(frozen=True)
class GrpcPrompt:
    """A GenerateRequest's prompt: its text when it came as text, and its token ids."""

    text: str | None
    token_ids: list[int]


def check_unsupported(request: pb.GenerateRequest) -> None:
    """Refuse the request fields jaxserve cannot honour, naming each."""
    if request.HasField("mm_inputs") or len(request.extra_mm_inputs) or \
            request.HasField("media_refs"):
        raise BadRequest("mm_inputs / extra_mm_inputs / media_refs: jaxserve serves text "
                         "models; multimodal inputs are not supported.")
    if request.HasField("kv_transfer_params") or request.HasField("kv_transfer_params_json"):
        raise BadRequest("kv_transfer_params: jaxserve has no KV transfer between prefill and "
                         "decode workers (disaggregated serving); send the request without "
                         "it.")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise BadRequest(f"data_parallel_rank={request.data_parallel_rank}: this engine "
                         "reports data_parallel_size 1 (it balances its own replicas); leave "
                         "the field unset or 0.")
    if request.WhichOneof("input") is None:
        raise BadRequest("input: give tokenized (input_ids) or text.")


def prompt_of(request: pb.GenerateRequest, encode) -> GrpcPrompt:
    """The prompt as token ids: tokenized.input_ids as given, or the text tokenized with the
    model's special tokens (as a completion prompt) by encode(text)."""
    if request.WhichOneof("input") == "tokenized":
        ids = list(request.tokenized.input_ids)
        if not ids:
            raise BadRequest("tokenized.input_ids must not be empty.")
        return GrpcPrompt(request.tokenized.original_text or None, ids)
    if not request.text:
        raise BadRequest("text must not be empty.")
    return GrpcPrompt(request.text, encode(request.text))


class NotPooling(ValueError):
    """An Embed on a model that does not embed (FAILED_PRECONDITION: the server's model,
    not the request, is what is wrong)."""


def embed_request(request: pb.EmbedRequest, processor, request_id: str):
    """An EmbedRequest as an admitted pooling request (admission.EngineRequest): its
    request id and input checked, its embedding settings resolved against the served model
    (NotPooling when it does not embed)."""
    processor.check_request_id(request_id)
    params = PoolingParams(task="embed")
    try:
        params.resolve(processor.pooler)  # (checked only: process_pooling resolves it)
    except ValueError as err:
        raise NotPooling(f"Embed: {err}") from None
    ids = list(request.tokenized.input_ids)
    if not ids:
        raise BadRequest("tokenized.input_ids must not be empty (Embed takes a tokenized "
                         "input).")
    processor.check_pooling_count(1, "tokenized")
    try:
        return processor.process_pooling(request_id, request.tokenized.original_text or None,
                                         ids, params)
    except ValueError as err:
        raise BadRequest(f"tokenized.input_ids: {err}") from None


def sampling_params(proto: pb.SamplingParams, *, starts_after: str | None = None
                    ) -> SamplingParams:
    """SamplingParams from the proto's, with vLLM's servicer's reading of proto3 defaults.
    starts_after: where a structured output starts when the engine's reasoning parser holds it
    back (None: from the first token, as with grammar_from_first_token)."""
    values = {
        "temperature": proto.temperature if proto.HasField("temperature") else 1.0,
        "top_k": proto.top_k, "min_p": proto.min_p,
        "frequency_penalty": proto.frequency_penalty,
        "presence_penalty": proto.presence_penalty,
        "max_tokens": proto.max_tokens if proto.HasField("max_tokens") else None,
        "min_tokens": proto.min_tokens, "stop": list(proto.stop),
        "stop_token_ids": list(proto.stop_token_ids),
        "skip_special_tokens": proto.skip_special_tokens,
        "spaces_between_special_tokens": proto.spaces_between_special_tokens,
        "ignore_eos": proto.ignore_eos, "n": proto.n or 1,
        "include_stop_str_in_output": proto.include_stop_str_in_output,
        "logit_bias": dict(proto.logit_bias) or None,
    }
    for name in UNSET_ONE:
        values[name] = getattr(proto, name) or 1.0
    for name in ("logprobs", "prompt_logprobs"):
        if proto.HasField(name):
            value = getattr(proto, name)
            if value == -1:
                raise BadRequest(f"{name}=-1 (the whole vocabulary) is not supported: at most "
                                 f"{MAX_LOGPROBS} per token.")
            values[name] = value
    if proto.HasField("seed"):
        values["seed"] = proto.seed
    if proto.HasField("truncate_prompt_tokens"):
        values["truncate_prompt_tokens"] = proto.truncate_prompt_tokens
    constraint = _constraint(proto, starts_after)
    if constraint is not None:
        values["structured_outputs"] = constraint
    return SamplingParams(**values)


def _constraint(proto: pb.SamplingParams, starts_after: str | None
                ) -> StructuredOutputsParams | None:
    kind = proto.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not proto.json_object):
        return None
    if kind == "structural_tag":
        raise BadRequest("structural_tag: structural tags are not supported; use json_schema, "
                         "regex, grammar, json_object or choice.")
    after = None if proto.grammar_from_first_token else starts_after
    if kind == "json_schema":
        return StructuredOutputsParams(json=proto.json_schema, starts_after=after)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(proto.choice.choices), starts_after=after)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, starts_after=after)
    return StructuredOutputsParams(**{kind: getattr(proto, kind)}, starts_after=after)


# ---- outputs -----------------------------------------------------------------------------
class ChoiceStream:
    """Turns one request's cumulative RequestOutputs into the proto's responses, choice by
    choice: what each choice has already sent, and whether the prompt logprobs went out."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sent: dict[int, int] = {}  # choice index -> tokens sent
        self.prompt_sent = False  # streamed: once per request, not once per choice
        self.completed: set[int] = set()

    def responses(self, output: RequestOutput, stream: bool) -> list[pb.GenerateResponse]:
        out = []
        for choice in output.outputs:
            if choice.index in self.completed:
                continue
            if stream:
                chunk = self._chunk(output, choice)
                if chunk is not None:
                    out.append(pb.GenerateResponse(chunk=chunk))
            if choice.finish_reason is not None:
                self.completed.add(choice.index)
                out.append(pb.GenerateResponse(complete=self.complete(output, choice,
                                                                      stream)))
        return out

    def _chunk(self, output: RequestOutput, choice: CompletionOutput
               ) -> pb.GenerateStreamChunk | None:
        start = self.sent.get(choice.index, 0)
        new = choice.token_ids[start:]
        # The prompt logprobs go with the request's first chunk that can carry them.
        prompt = not self.prompt_sent and self._prompt_ready(output)
        if not new and not prompt and (start or choice.finish_reason is None):
            return None
        self.sent[choice.index] = len(choice.token_ids)
        chunk = pb.GenerateStreamChunk(
            token_ids=new, prompt_tokens=len(self.prompt_token_ids),
            completion_tokens=len(new), cached_tokens=output.num_cached_tokens,
            index=choice.index)
        if self.params.logprobs is not None and choice.logprobs is not None:
            chunk.output_logprobs.CopyFrom(self._output_logprobs(choice, start))
        if prompt:
            self.prompt_sent = True
            chunk.input_logprobs.CopyFrom(self._input_logprobs(output))
        return chunk

    def complete(self, output: RequestOutput, choice: CompletionOutput, stream: bool
                 ) -> pb.GenerateComplete:
        """The choice's GenerateComplete; unstreamed, choice 0's carries the prompt
        logprobs (streamed, a chunk did)."""
        complete = pb.GenerateComplete(
            output_ids=choice.token_ids, finish_reason=choice.finish_reason or "stop",
            prompt_tokens=len(self.prompt_token_ids), completion_tokens=len(choice.token_ids),
            cached_tokens=output.num_cached_tokens, index=choice.index)
        if self.params.logprobs is not None and choice.logprobs is not None:
            complete.output_logprobs.CopyFrom(self._output_logprobs(choice, 0))
        if not stream and choice.index == 0 and output.prompt_logprobs is not None:
            complete.input_logprobs.CopyFrom(self._input_logprobs(output))
        if isinstance(choice.stop_reason, str):
            complete.matched_stop_str = choice.stop_reason
        elif choice.stop_reason is not None:
            complete.matched_token_id = int(choice.stop_reason)
        return complete

    def _prompt_ready(self, output: RequestOutput) -> bool:
        """Whether the prompt logprobs are all in, or the request ended without them all.
        Choice 0 computes them: with n > 1 another choice may sample first."""
        logprobs = output.prompt_logprobs
        return logprobs is not None and (len(logprobs) >= len(self.prompt_token_ids)
                                         or output.finished)

    def _output_logprobs(self, choice: CompletionOutput, start: int) -> pb.OutputLogProbs:
        k = self.params.logprobs
        out = pb.OutputLogProbs()
        for token, entry in zip(choice.token_ids[start:], choice.logprobs[start:]):
            out.token_ids.append(token)
            out.token_logprobs.append(entry[token].logprob)
            if k:
                out.top_logprobs.append(_top(entry, k))
        return out

    def _input_logprobs(self, output: RequestOutput) -> pb.InputLogProbs:
        k = self.params.prompt_logprobs
        out = pb.InputLogProbs(token_ids=self.prompt_token_ids)
        for token, entry in zip(self.prompt_token_ids, output.prompt_logprobs):
            value = pb.InputTokenLogProb()
            if entry is not None:
                value.value = entry[token].logprob
            out.token_logprobs.append(value)
            if k:
                out.top_logprobs.append(_top(entry, k) if entry is not None else pb.TopLogProbs())
        return out


def _top(entry: dict, k: int) -> pb.TopLogProbs:
    """The k most likely tokens of one position, most likely first."""
    ranked = sorted(((lp.rank if lp.rank is not None else math.inf, token, lp.logprob)
                     for token, lp in entry.items()), key=lambda x: (x[0], x[1]))
    ranked = [r for r in ranked if r[0] <= k][:k]
    return pb.TopLogProbs(values=[lp for _, _, lp in ranked],
                          token_ids=[token for _, token, _ in ranked])

