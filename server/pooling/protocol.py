"""Request schemas of the pooling routes, as vLLM declares them: /v1/embeddings
(EmbeddingCompletionRequest and EmbeddingChatRequest), /pooling (PoolingRequest), /classify
(ClassificationRequest), /score and /v1/score (ScoreRequest), /rerank, /v1/rerank and
/v2/rerank (RerankRequest).

The completion form (`input`: a string, strings, token ids or token-id lists) and the chat
form (`messages`, rendered with the chat template; add_generation_prompt and
add_special_tokens default to false there, as vLLM's chat requests) share one schema per
route: exactly one of the two is given. Score inputs are strings or text-only content
objects ({"content": [{"type": "text", "text": ...}]}, vLLM's; {"text": ...}, Jina's and
Cohere's). Every field is honoured or, when set to something jaxserve cannot do, refused with
a 400 naming it (_REFUSED); unknown fields are kept and logged once (schema_base.py). The
pooling settings (dimensions, normalize, use_activation, truncate_prompt_tokens) go to the
engine's PoolingParams, which the admission path resolves against the served model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from jaxserve.core.sampling_params import INT64_MAX, INT64_MIN
from jaxserve.server.openai.chat_messages import ChatMessage
from jaxserve.server.openai.protocol import MAX_CACHE_SALT
from jaxserve.server.schema_base import Body, ParamError

EMBED_DTYPES = ("float32", "float16", "bfloat16")  # base64 encodings served
# vLLM's other embed_dtype values: refused by name
_FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")
# vLLM's pooling tasks that jaxserve's engine has no pooler for
_TOKEN_TASKS = ("token_embed", "token_classify", "plugin")


def _set(value) -> bool:
    return value is not None


# Fields of features jaxserve does not have: (is it set?, why it is refused).
_REFUSED: dict[str, tuple[Any, str]] = {
    "mm_processor_kwargs": (_set, "this server takes text only (no multimodal processor)"),
    "media_io_kwargs": (_set, "this server takes text only (no media loading)"),
    "padding": (lambda v: v == "max_length", "padding='max_length' is not supported: prompts "
                "are pooled as they are (do_not_pad)"),
    "truncation_side": (lambda v: v == "right", "truncation_side='right' is not supported: "
                        "truncate_prompt_tokens keeps the last tokens (left)"),
    "max_tokens_per_query": (bool, "per-query truncation is not supported; use "
                             "truncate_prompt_tokens"),
    "max_tokens_per_doc": (bool, "per-document truncation is not supported; use "
                           "truncate_prompt_tokens"),
    "instruction": (_set, "score templates (instructions) are not supported: pairs are "
                    "tokenized as tokenizer(text_1, text_2)"),
}


class _PoolingBody(Body):
    """The fields every pooling request has (vLLM's PoolingBasicRequestMixin)."""

    model: str | None = None
    user: str | None = None  # an end-user id for the caller's records; no effect (as vLLM)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    mm_processor_kwargs: dict | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)

    def check(self) -> None:
        """Refuse what jaxserve cannot honour, naming the field (ParamError)."""
        for name, (is_set, why) in _REFUSED.items():
            if name in type(self).model_fields and is_set(getattr(self, name)):
                raise ParamError(name, f"{name}: {why}.")
        if self.cache_salt is not None and any(c in self.cache_salt for c in "@/\\\0"):
            raise ParamError("cache_salt", "cache_salt must not contain '@', '/', '\\' or NUL.")


class _InputBody(_PoolingBody):
    """vLLM's *CompletionRequest (input) and *ChatRequest (messages) forms in one schema."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for input, false for messages
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict | None = None

    def check(self) -> None:
        super().check()
        if (self.input is None) == (self.messages is None):
            raise ParamError("input", "give exactly one of input (texts or token ids) or "
                             "messages (a conversation, rendered with the chat template).")
        if self.messages is not None and not self.messages:
            raise ParamError("messages", "messages must not be empty.")
        if self.input is not None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template",
                         "chat_template_kwargs"):
                if name in self.model_fields_set:
                    raise ParamError(name, f"{name} applies to the chat form (messages), "
                                     "not to input.")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message", "Cannot set both continue_final_message "
                             "and add_generation_prompt to true.")

    @property
    def adds_special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.messages is None

    def template_kwargs(self, server_defaults: dict) -> dict:
        """What the chat template sees besides the messages: the server's defaults, then
        the request's chat_template_kwargs, then continue_final_message."""
        kwargs = dict(server_defaults)
        kwargs.update(self.chat_template_kwargs or {})
        kwargs.pop("add_generation_prompt", None)
        kwargs["continue_final_message"] = self.continue_final_message
        return kwargs


class _Encoded(Body):
    """How vectors are sent (vLLM's EncodingRequestMixin)."""

    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: str = "float32"  # base64's element type
    endianness: Literal["native", "big", "little"] = "native"  # base64's byte order

    def check_encoding(self) -> None:
        if self.embed_dtype in _FP8_DTYPES:
            raise ParamError("embed_dtype", f"embed_dtype {self.embed_dtype!r} is not "
                             f"supported; use one of {', '.join(EMBED_DTYPES)}.")
        if self.embed_dtype not in EMBED_DTYPES:
            raise ParamError("embed_dtype", f"embed_dtype must be one of "
                             f"{', '.join(EMBED_DTYPES)}, got {self.embed_dtype[:40]!r}.")


class EmbeddingRequest(_InputBody, _Encoded):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's extras)."""

    dimensions: int | None = None
    use_activation: bool | None = None  # vLLM's name of normalize for embeddings
    normalize: bool | None = None  # vLLM's older name

    def check(self) -> None:
        super().check()
        self.check_encoding()
        if self.dimensions is not None and self.dimensions < 1:
            raise ParamError("dimensions", f"dimensions must be >= 1, got {self.dimensions}.")

    @property
    def normalized(self) -> bool | None:
        """L2 normalization as asked (use_activation or normalize; None: the model's)."""
        if None not in (self.use_activation, self.normalize) and \
                self.use_activation != self.normalize:
            raise ParamError("normalize", "normalize and use_activation (vLLM's newer name "
                             "for it) disagree; give one.")
        return self.use_activation if self.use_activation is not None else self.normalize


class PoolingRequest(EmbeddingRequest):
    """POST /pooling: the model's own pooled output (vLLM's PoolingRequest)."""

    task: str | None = None  # None or "encode": the engine's; "embed", "classify"

    def check(self) -> None:
        super().check()
        if self.task in _TOKEN_TASKS:
            raise ParamError("task", f"task {self.task!r}: per-token pooling and plugins are "
                             "not supported; use embed, classify or encode.")
        if self.task not in (None, "embed", "classify", "encode"):
            raise ParamError("task", f"task must be one of embed, classify or encode, got "
                             f"{str(self.task)[:40]!r}.")


class ClassificationRequest(_InputBody):
    """POST /classify (vLLM's ClassificationRequest)."""

    use_activation: bool | None = None  # softmax (sigmoid for one label); false: logits


# ---- scores -------------------------------------------------------------------------------
def score_text(item, where: str = ""):
    """A score input as its text: a string, {"text": ...} (Jina's and Cohere's documents)
    or {"content": [text parts]} (vLLM's ScoreMultiModalParam, text only); anything else
    is left for the schema to refuse."""
    if not isinstance(item, dict):
        return item
    if set(item) == {"text"} and isinstance(item["text"], str):
        return item["text"]
    content = item.get("content")
    if set(item) - {"content"} or not isinstance(content, list) or not content:
        raise ValueError(f"{where}an input object must be {{\"text\": ...}} or "
                         "{\"content\": [text parts]}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}content part type {str(kind)[:40]!r}: only text parts "
                             "({\"type\": \"text\", \"text\": ...}) are supported (jaxserve "
                             "serves text models)")
        texts.append(part["text"])
    return "".join(texts)


def _score_texts(cls, value, info):
    """A side of a score (one input or a list of them), its objects as their texts."""
    if isinstance(value, list):
        return [score_text(item, f"item {i}: ") for i, item in enumerate(value)]
    return score_text(value)


ScoreItems = str | list[str]


class _ScoringBody(_PoolingBody):
    """vLLM's ScoringRequestMixin."""

    use_activation: bool | None = None  # cross-encoders: sigmoid; false: the raw logit
    max_tokens_per_query: int = Field(0, ge=0)
    max_tokens_per_doc: int = Field(0, ge=0)
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.chat_template_kwargs:
            raise ParamError("chat_template_kwargs", "chat_template_kwargs: score templates "
                             "are not supported: pairs are tokenized as tokenizer(text_1, "
                             "text_2).")


# The field pairs a score request may name its two sides with (vLLM's four forms).
SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                ("data_1", "data_2"))


class ScoreRequest(_ScoringBody):
    """POST /score, /v1/score: text_1/text_2, queries/documents, queries/items or
    data_1/data_2; 1:1, 1:N or N:N."""

    text_1: ScoreItems | None = None
    text_2: ScoreItems | None = None
    queries: ScoreItems | None = None
    documents: ScoreItems | None = None
    items: ScoreItems | None = None
    data_1: ScoreItems | None = None
    data_2: ScoreItems | None = None

    objects_as_texts = field_validator("text_1", "text_2", "queries", "documents", "items",
                                       "data_1", "data_2", mode="before")(_score_texts)

    def sides(self) -> tuple[tuple[str, list], tuple[str, list]]:
        """((field, inputs), (field, inputs)): the two sides, each as a list."""
        given = [(a, b) for a, b in SCORE_FIELDS
                 if getattr(self, a) is not None and getattr(self, b) is not None]
        if len(given) != 1:
            named = " or ".join(f"{a}/{b}" for a, b in SCORE_FIELDS)
            raise ParamError("text_1", f"give one pair of inputs to score: {named}"
                             f"{' (not several)' if given else ''}.")
        (first, second), = given
        for name in {n for pair in SCORE_FIELDS for n in pair} - {first, second}:
            if getattr(self, name) is not None:
                raise ParamError(name, f"{name} does not go with {first}/{second}.")
        return (first, _as_list(getattr(self, first))), (second, _as_list(getattr(self,
                                                                                  second)))


class RerankRequest(_ScoringBody):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape, vLLM's fields)."""

    query: str
    documents: ScoreItems
    top_n: int = Field(0, ge=0)  # 0: every document
    return_documents: bool = True

    objects_as_texts = field_validator("query", "documents", mode="before")(_score_texts)

    @property
    def document_list(self) -> list:
        return _as_list(self.documents)


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]
