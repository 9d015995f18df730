"""OpenAI response objects for one HTTP request: engine outputs -> JSON (completions and
chat, with vLLM's additions) or SSE chunks, content and tool-call deltas, usage.

Streams send only text the detokenizer has released (never part of a stop string), exactly
one chunk per choice with a finish_reason, and, with stream_options.include_usage, a last
chunk with the usage.
"""

from __future__ import annotations

import time

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.parsers.reasoning import reasoning_parser
from jaxserve.parsers.tools import tool_parser
from jaxserve.server.openai.tool_calls import ChoiceTools


class ResponseView:
    """Turns engine outputs into OpenAI response objects (with vLLM's additions) for one HTTP
    request."""

    def __init__(self, kind: str, request_id: str, model: str, body, prompts, serving) -> None:
        self.chat = kind == "chat.completion"
        self.kind, self.id, self.model, self.body = kind, request_id, model, body
        self.created = int(time.time())
        self.n = body.n
        self.prompts = prompts
        self.serving = serving
        self.echo = bool(body.echo) and not self.chat
        self.chat_echo = body.echo_text if self.chat else ""
        self.prompt_only = bool(getattr(body, "scores_prompt_only", False))
        self.token_ids = bool(body.return_token_ids)
        self.as_ids = bool(body.return_tokens_as_token_ids
                           if body.return_tokens_as_token_ids is not None
                           else serving.options.return_tokens_as_token_ids)
        self.interval = body.stream_interval or 1
        total = len(prompts) * self.n
        self.reasoning = None
        if self.chat and serving.chat.reasoning_parser is not None:
            self.reasoning = reasoning_parser(serving.chat.reasoning_parser)
        self.include_reasoning = bool(getattr(body, "include_reasoning", True))
        self.sent_reasoning = [0] * total
        self.sent_answer = [0] * total
        mode = body.tool_mode if self.chat else None
        self.tools = None
        if mode is not None:
            parser = (tool_parser(serving.chat.tool_call_parser)
                      if mode == "auto" else None)
            self.tools = [ChoiceTools(mode, parser, body.named_tool,
                                      body.parallel_tool_calls is not False)
                          for _ in range(total)]
        self.sent_text = [0] * total
        self.sent_tokens = [0] * total
        self.finished = [False] * total
        self.completion_tokens = [0] * total
        self.text_offsets = [0] * total
        self.cached_tokens = [0] * len(prompts)

    # ---- non-streamed -------------------------------------------------------------------
    def full_response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, output in enumerate(finals):
            self.cached_tokens[p] = output.num_cached_tokens
            for c in output.outputs:
                index = p * self.n + c.index
                generated = [] if self.prompt_only else c.token_ids
                self.completion_tokens[index] = len(generated)
                if self.chat:
                    text, reasoning = c.text, None
                    if self.reasoning is not None:
                        reasoning, text = self.reasoning.split(c.text, final=True)
                    message = {"role": "assistant", "content": (
                        self.chat_echo + text if text is not None or self.chat_echo else None)}
                    finish = c.finish_reason
                    if self.tools is not None:
                        message, finish = self.tools[index].message(text or "",
                                                                    c.finish_reason)
                    if self.reasoning is not None and self.include_reasoning:
                        message["reasoning_content"] = message["reasoning"] = reasoning
                    choice = {"index": index, "message": message,
                              "logprobs": self._chat_logprobs(c, 0),
                              "finish_reason": finish, "stop_reason": c.stop_reason}
                else:
                    text = "" if self.prompt_only else c.text
                    if self.echo:
                        text = self._prompt_text(p) + text
                    choice = {"index": index, "text": text,
                              "logprobs": self._completion_logprobs(output, c, 0, True, index),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "prompt_logprobs": self._prompt_logprobs(output)}
                    if self.token_ids:
                        choice["prompt_token_ids"] = output.prompt_token_ids
                if self.token_ids:
                    choice["token_ids"] = list(generated)
                choices.append(choice)
        response = {"id": self.id, "object": self.kind, "created": self.created,
                    "model": self.model, "choices": choices, "usage": self._usage()}
        if self.chat:
            response["prompt_logprobs"] = self._prompt_logprobs(finals[0])
            if self.token_ids:
                response["prompt_token_ids"] = finals[0].prompt_token_ids
            if self.body.return_prompt_text:
                response["prompt_text"] = self._prompt_text(0)
        return response

    # ---- streamed -----------------------------------------------------------------------
    def opening_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        chunks = [self._chunk(i, {"role": "assistant", "content": ""}, None, None)
                  for i in range(self.n)]
        if self.token_ids:
            chunks[0]["prompt_token_ids"] = self.prompts[0][1]
        if self.body.return_prompt_text:
            chunks[0]["prompt_text"] = self._prompt_text(0)
        if self.chat_echo:
            chunks += [self._chunk(i, {"content": self.chat_echo}, None, None)
                       for i in range(self.n)]
        if self.body.continuous_usage:
            for chunk in chunks:
                chunk["usage"] = self._usage()
        return chunks

    def chunks(self, p: int, output: RequestOutput) -> list[dict]:
        out = []
        self.cached_tokens[p] = output.num_cached_tokens
        for c in output.outputs:
            index = p * self.n + c.index
            if self.finished[index]:
                continue
            done = c.finish_reason is not None
            start = self.sent_tokens[index]
            if not done and len(c.token_ids) - start < self.interval:
                continue  # stream_interval: wait for more tokens
            first = start == 0 and self.sent_text[index] == 0
            if self.tools is not None or self.reasoning is not None:
                out += self._parsed_chunks(index, c, start)
                continue
            delta = "" if self.prompt_only else c.text[self.sent_text[index]:]
            if self.echo and first:
                delta = self._prompt_text(p) + delta
            if not delta and not done and (c.logprobs is None or len(c.token_ids) == start):
                continue  # nothing to show yet (text held back, or no new tokens)
            logprobs = (self._chat_logprobs(c, start) if self.chat else
                        self._completion_logprobs(output, c, start, first, index))
            self.sent_text[index] = len(c.text)
            self.sent_tokens[index] = len(c.token_ids)
            self.completion_tokens[index] = 0 if self.prompt_only else len(c.token_ids)
            self.finished[index] = done
            payload = {"content": delta} if self.chat else delta
            chunk = self._chunk(index, payload, logprobs, c.finish_reason, c.stop_reason)
            choice = chunk["choices"][0]
            if self.token_ids:
                choice["token_ids"] = [] if self.prompt_only else c.token_ids[start:]
                if first and not self.chat:
                    choice["prompt_token_ids"] = output.prompt_token_ids
            if self.body.continuous_usage:
                chunk["usage"] = self._usage()
            out.append(chunk)
        return out

    def _parsed_chunks(self, index: int, c: CompletionOutput, start: int) -> list[dict]:
        """A chat choice read by a reasoning parser and/or in a tool mode: reasoning,
        content and tool-call deltas."""
        done = c.finish_reason is not None
        text, deltas, finish = c.text, [], c.finish_reason
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(c.text, final=done)
            reasoning, text = reasoning or "", text or ""
            if len(reasoning) > self.sent_reasoning[index]:
                piece = reasoning[self.sent_reasoning[index]:]
                self.sent_reasoning[index] = len(reasoning)
                if self.include_reasoning:
                    deltas.append({"reasoning_content": piece, "reasoning": piece})
        if self.tools is not None:
            more, finish = self.tools[index].deltas(text, c.finish_reason)
            deltas += more
        elif len(text) > self.sent_answer[index]:
            deltas.append({"content": text[self.sent_answer[index]:]})
            self.sent_answer[index] = len(text)
        logprobs = self._chat_logprobs(c, start)
        self.sent_text[index] = len(c.text)
        self.sent_tokens[index] = len(c.token_ids)
        self.completion_tokens[index] = len(c.token_ids)
        done = c.finish_reason is not None
        self.finished[index] = done
        if done and not deltas:
            deltas = [{}]
        chunks = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            chunk = self._chunk(index, delta, logprobs if i == 0 else None,
                                finish if last and done else None,
                                c.stop_reason if last and done else None)
            if self.body.continuous_usage:
                chunk["usage"] = self._usage()
            chunks.append(chunk)
        return chunks

    def usage_chunk(self) -> dict | None:
        if not (self.body.include_usage or self.serving.options.force_include_usage):
            return None
        return {"id": self.id, "object": self._chunk_kind(), "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage()}

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index, payload, logprobs, finish_reason, stop_reason=None) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = payload
        else:
            choice["text"] = payload
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {"id": self.id, "object": self._chunk_kind(), "created": self.created,
                "model": self.model, "choices": [choice]}

    # ---- pieces -------------------------------------------------------------------------
    def _usage(self) -> dict:
        prompt = sum(len(ids) for _, ids in self.prompts)
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def _prompt_text(self, p: int) -> str:
        text, ids = self.prompts[p]
        if text is not None:
            return text
        return self.serving.tokenizer.decode(ids, skip_special_tokens=not self.chat)

    def _token_text(self, token: int, lp) -> str:
        if self.as_ids:
            return f"token_id:{token}"
        return lp.decoded_token or ""

    def _prompt_logprobs(self, output: RequestOutput) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id:
        {logprob, rank, decoded_token}} (the prompt's token and the top ones)."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else
                {str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                          "decoded_token": self._token_text(t, lp)}
                 for t, lp in entry.items()}
                for entry in output.prompt_logprobs]

    def _chat_logprobs(self, c: CompletionOutput, start: int) -> dict | None:
        if c.logprobs is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            top = sorted(((t, lp) for t, lp in entry.items()
                          if lp.rank is not None and lp.rank <= k), key=lambda x: x[1].rank)
            content.append({**self._token_entry(token, entry[token]),
                            "top_logprobs": [self._token_entry(t, lp) for t, lp in top[:k]]})
        return {"content": content}

    def _token_entry(self, token: int, lp) -> dict:
        text = self._token_text(token, lp)
        return {"token": text, "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode("utf-8"))}

    def _completion_logprobs(self, output: RequestOutput, c: CompletionOutput, start: int,
                             with_prompt: bool, index: int) -> dict | None:
        if c.logprobs is None:
            return None
        rows = []  # (token text, logprob, {token text: logprob}) per position
        if self.echo and with_prompt and output.prompt_logprobs is not None:
            for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
                rows.append(self._completion_row(token, entry) if entry is not None else
                            (self._token_text(token, _Plain(token, self.serving)), None, None))
        if not self.prompt_only:
            rows += [self._completion_row(t, e)
                     for t, e in zip(c.token_ids[start:], c.logprobs[start:])]
        offsets, position = [], self.text_offsets[index]  # continues across stream chunks
        for token, _, _ in rows:
            offsets.append(position)
            position += len(token)
        self.text_offsets[index] = position
        return {"tokens": [r[0] for r in rows], "token_logprobs": [r[1] for r in rows],
                "top_logprobs": [r[2] for r in rows], "text_offset": offsets}

    def _completion_row(self, token: int, entry: dict) -> tuple:
        return (self._token_text(token, entry[token]), entry[token].logprob,
                {self._token_text(t, lp): lp.logprob for t, lp in entry.items()})


class _Plain:
    """The decoded text of a prompt token that has no logprob entry (the first)."""

    def __init__(self, token: int, serving) -> None:
        self.decoded_token = serving.tokenizer.decode([token])
