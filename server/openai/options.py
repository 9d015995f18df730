"""The server-wide settings of the OpenAI routes (vLLM's flags): chat templates, tool and
reasoning parsers, response and request-log options. Read by server/openai/serving.py and the
routes built on it; made by jaxserve/cli/serve.py."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat-template settings (vLLM's flags)."""

    template: str | None = None  # --chat-template: instead of the tokenizer's own
    default_kwargs: dict = dataclasses.field(default_factory=dict)  # --default-chat-template-kwargs
    trust_request_template: bool = False  # --trust-request-chat-template
    # --enable-auto-tool-choice --tool-call-parser NAME: tool_choice "auto" reads calls out
    # of the model's text with this parser (jaxserve/parsers/tools.py).
    tool_call_parser: str | None = None
    # --reasoning-parser NAME: the thinking goes to reasoning_content (and reasoning), and
    # a structured output applies after it (jaxserve/parsers/reasoning.py).
    reasoning_parser: str | None = None
    # --exclude-tools-when-tool-choice-none: tool_choice "none" renders no tools
    exclude_tools_when_none: bool = False


@dataclasses.dataclass(frozen=True)
class ResponseOptions:
    """Server-wide response and request-log settings (vLLM's flags)."""

    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    force_include_usage: bool = False  # usage in every stream, as if include_usage were set
    log_requests: bool = False  # --enable-log-requests: lines per request (received, finished)
    log_outputs: bool = False  # --enable-log-outputs: the finished line's output text too
    max_log_len: int | None = None  # --max-log-len: characters / ids of prompts and outputs
