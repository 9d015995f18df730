"""Engine outputs of one /v1/responses request -> output items, stream events and the final
Response object.

One state machine serves both forms: each engine output is read as the chat path reads it
(the reasoning parser splits off the thinking, tool_calls.ChoiceTools reads the calls under
the tool mode) and turned into the Responses API's semantic events, opening and closing
output items as the kind of text changes: a `reasoning` item (reasoning_text), a `message`
item (one output_text part), a `function_call` item per call. A non-streamed response feeds
its last output through the same machine and keeps only the items, so the streamed events
always join up to the non-streamed answer.

Events, in order (OpenAI's types in openai/types/responses/): response.output_item.added,
response.content_part.added, response.output_text.delta / response.reasoning_text.delta /
response.function_call_arguments.delta, then .done, response.content_part.done,
response.output_item.done. The serving side adds response.created, response.in_progress,
the terminal response.completed / response.incomplete / response.failed, and numbers them.
"""

from __future__ import annotations

import copy
import time
import uuid

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.parsers.reasoning import END, START, ReasoningParser
from jaxserve.server.openai.tool_calls import ChoiceTools

# finish_reason -> the response's status (stop: completed)
_STATUS = {"length": "incomplete", "abort": "cancelled"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """The answer to one /v1/responses request.

    head: the Response object's fields that do not depend on the output (id, model, the
    echoed request fields); tools: the request's ChoiceTools (None without a tool mode);
    reasoning: the server's reasoning parser (None without one); top_logprobs: None when no
    logprobs are included, else the alternatives per token; tokenizer: for token texts and
    reasoning token counts; as_ids: name tokens 'token_id:N' (--return-tokens-as-token-ids).
    on_final(response): called once with the final Response object (the store)."""

    def __init__(self, head: dict, *, tools: ChoiceTools | None,
                 reasoning: ReasoningParser | None, top_logprobs: int | None, tokenizer,
                 as_ids: bool = False, on_final=None) -> None:
        self.head, self.tools, self.reasoning = head, tools, reasoning
        self.top, self.tokenizer, self.as_ids, self.on_final = top_logprobs, tokenizer, \
            as_ids, on_final
        self.items: list[dict] = []  # output items; the open one (if any) last
        self.open: str | None = None  # its type: "reasoning", "message" or "function_call"
        self.sent_reasoning = self.sent_answer = self.sent_tokens = 0
        self.logprobs: list[dict] = []  # every generated token's entry
        self.pending: list[dict] = []  # entries not yet sent with a text delta
        self.reasoning_text = ""
        self.output: CompletionOutput | None = None
        self.prompt_tokens = self.cached_tokens = 0

    # ---- the whole response -------------------------------------------------------------
    def created(self) -> dict:
        """The Response object while it is generated (response.created, .in_progress)."""
        return {**self.head, "status": "in_progress", "output": [], "usage": None}

    def full_response(self, finals: list[RequestOutput]) -> dict:
        """The non-streamed answer (OpenAIServing.respond_whole calls it off the event loop)."""
        self.feed(finals[0])
        return self.final()

    def final(self) -> dict:
        """The finished Response object; handed to on_final once."""
        finish = self.output.finish_reason if self.output is not None else "abort"
        status = _STATUS.get(finish, "completed")
        response = {**self.head, "status": status, "output": self.items,
                    "usage": self._usage(), "completed_at": (
                        int(time.time()) if status == "completed" else None)}
        if finish == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "cancelled":
            response["error"] = {"code": "server_error", "message": "The request was aborted "
                                 "before it finished (the server is shutting down)."}
        if self.on_final is not None:
            self.on_final(response)
            self.on_final = None
        return response

    def _usage(self) -> dict:
        output = len(self.output.token_ids) if self.output is not None else 0
        return {"input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": self.prompt_tokens + output}

    def _reasoning_tokens(self) -> int:
        """The generated tokens inside the thinking: counted on the token ids between the
        markers when each is one token, else the reasoning text's own tokens."""
        if self.output is None or not self.reasoning_text:
            return 0
        ids = list(self.output.token_ids)
        start, end = (self.tokenizer.encode(m, add_special_tokens=False) for m in (START, END))
        if len(start) == 1 and len(end) == 1:
            first = ids.index(start[0]) + 1 if start[0] in ids else 0
            last = ids.index(end[0], first) if end[0] in ids[first:] else len(ids)
            return max(0, last - first)
        return len(self.tokenizer.encode(self.reasoning_text, add_special_tokens=False))

    # ---- one engine output at a time ----------------------------------------------------
    def feed(self, output: RequestOutput) -> list[dict]:
        """The events the output adds (without sequence numbers)."""
        c = output.outputs[0]
        self.output, done = c, c.finish_reason is not None
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        if self.top is not None and c.logprobs is not None:
            new = [self._entry(t, e) for t, e in zip(c.token_ids[self.sent_tokens:],
                                                     c.logprobs[self.sent_tokens:])]
            self.logprobs += new
            self.pending += new
        self.sent_tokens = len(c.token_ids)
        events: list[dict] = []
        text = c.text
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(c.text, final=done)
            reasoning, text = reasoning or "", text or ""
            if len(reasoning) > self.sent_reasoning:
                events += self._reasoning_delta(reasoning[self.sent_reasoning:])
                self.sent_reasoning = len(reasoning)
            self.reasoning_text = reasoning
        if self.tools is not None and (text or done):  # a named call opens with its text
            deltas, _ = self.tools.deltas(text, c.finish_reason)
            for delta in deltas:
                if delta.get("content"):
                    events += self._text_delta(delta["content"])
                for call in delta.get("tool_calls", ()):
                    events += self._call_delta(call)
        elif len(text) > self.sent_answer:
            events += self._text_delta(text[self.sent_answer:])
            self.sent_answer = len(text)
        if done:
            if not self.items:  # nothing at all: an empty message, as OpenAI answers
                events += self._open_message()
            events += self._close("incomplete" if c.finish_reason == "length" else
                                  "completed")
        return events

    def _event(self, kind: str, **fields) -> dict:
        return {"type": f"response.{kind}", "output_index": len(self.items) - 1, **fields}

    def _part_event(self, kind: str, **fields) -> dict:
        return self._event(kind, item_id=self.items[-1]["id"], content_index=0, **fields)

    def _open(self, item: dict) -> list[dict]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item["type"]
        return events + [self._event("output_item.added", item=copy.deepcopy(item))]

    def _reasoning_delta(self, piece: str) -> list[dict]:
        events = []
        if self.open != "reasoning":
            events += self._open({"id": _id("rs"), "type": "reasoning", "summary": [],
                                  "status": "in_progress"})
            events.append(self._part_event("content_part.added",
                                           part={"type": "reasoning_text", "text": ""}))
            self.items[-1]["content"] = [{"type": "reasoning_text", "text": ""}]
        self.items[-1]["content"][0]["text"] += piece
        return events + [self._part_event("reasoning_text.delta", delta=piece)]

    def _open_message(self) -> list[dict]:
        events = self._open({"id": _id("msg"), "type": "message", "role": "assistant",
                             "status": "in_progress", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._part_event("content_part.added", part=dict(part)))
        self.items[-1]["content"].append(part)
        return events

    def _text_delta(self, piece: str) -> list[dict]:
        events = self._open_message() if self.open != "message" else []
        self.items[-1]["content"][0]["text"] += piece
        events.append(self._part_event("output_text.delta", delta=piece,
                                       logprobs=self.pending))
        self.pending = []
        return events

    def _call_delta(self, call: dict) -> list[dict]:
        """A chat tool-call delta: a new call (with its id and name) or more arguments."""
        function = call.get("function") or {}
        events = []
        if "id" in call:
            events += self._open({"id": _id("fc"), "type": "function_call",
                                  "call_id": call["id"], "name": function.get("name", ""),
                                  "arguments": "", "status": "in_progress"})
        piece = function.get("arguments") or ""
        if piece:
            self.items[-1]["arguments"] += piece
            events.append(self._event("function_call_arguments.delta",
                                      item_id=self.items[-1]["id"], delta=piece))
        return events

    def _close(self, status: str) -> list[dict]:
        """The events that end the open item (none when no item is open)."""
        if self.open is None:
            return []
        item, kind = self.items[-1], self.open
        item["status"] = status
        self.open = None
        events = []
        if kind == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._part_event("reasoning_text.done", text=text))
            events.append(self._part_event("content_part.done",
                                           part={"type": "reasoning_text", "text": text}))
        elif kind == "message":
            part = item["content"][0]
            part["logprobs"] = list(self.logprobs)
            events.append(self._part_event("output_text.done", text=part["text"],
                                           logprobs=part["logprobs"]))
            events.append(self._part_event("content_part.done", part=dict(part)))
        else:
            events.append(self._event("function_call_arguments.done", item_id=item["id"],
                                      name=item["name"], arguments=item["arguments"]))
        return events + [self._event("output_item.done", item=dict(item))]

    # ---- logprobs -----------------------------------------------------------------------
    def _entry(self, token: int, entry: dict) -> dict:
        """One token's logprob with its top alternatives (output_text.logprobs)."""
        top = sorted(((t, lp) for t, lp in entry.items()
                      if lp.rank is not None and lp.rank <= self.top), key=lambda x: x[1].rank)
        return {**self._token(token, entry[token]),
                "top_logprobs": [self._token(t, lp) for t, lp in top[:self.top]]}

    def _token(self, token: int, lp) -> dict:
        text = f"token_id:{token}" if self.as_ids else (lp.decoded_token or "")
        return {"token": text, "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode("utf-8"))}
