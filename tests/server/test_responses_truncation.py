"""Bounded /v1/responses conversations: truncation "auto" drops whole input items, oldest
first, and keeps the instructions (greedy text equal to /v1/chat/completions' on the kept
part); a stored response keeps what was used, so a chain of long turns does not grow; the
store is bounded in bytes; the end-user ids have length limits. fit itself on the tiny
tokenizer: counts, cuts, and texts too long to fit never tokenized whole."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from jaxserve.server.responses.store import ResponseStore, StoredResponse, entry_size
from jaxserve.server.responses.truncation import MessageCounter, fit, longest_token_chars

R = "/v1/responses"
USER = "Write a function."
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=10)
LONG = " ".join(f"word{i}" for i in range(700))  # past the shared server's 512 tokens


@pytest.fixture(scope="module")
def client(api_server):
    with openai.OpenAI(base_url=api_server.api, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(api_server):
    with httpx.Client(base_url=api_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])


def chat(client, messages):
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_tokens=10)
    return resp.choices[0].message.content, resp.usage.prompt_tokens


@pytest.mark.parametrize("instructions", ["Answer in French.", "You are a pirate."])
def test_auto_drops_whole_oldest_items_and_keeps_the_instructions(client, instructions):
    items = [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Sure."},
             {"role": "user", "content": USER}]
    resp = client.responses.create(input=items, instructions=instructions,
                                   truncation="auto", **GREEDY)
    # The long item is dropped whole (and the answer to it, which no question opens now).
    text, tokens = chat(client, [{"role": "system", "content": instructions},
                                 {"role": "user", "content": USER}])
    assert (resp.output_text, resp.usage.input_tokens) == (text, tokens)


def test_a_chain_keeps_what_was_used(client, http):
    first = client.responses.create(input=LONG, instructions="Be brief.", truncation="auto",
                                    **GREEDY)
    assert first.usage.input_tokens <= 512 - 10
    # The first turn's own input was cut to fit; the next turn's does not fit beside it,
    # so it is dropped whole rather than carried (and cut again) turn after turn.
    second = client.responses.create(input=USER, previous_response_id=first.id,
                                     truncation="auto", **GREEDY)
    text, tokens = chat(client, [{"role": "user", "content": USER}])
    assert (second.output_text, second.usage.input_tokens) == (text, tokens)
    # Short turns still carry the conversation.
    third = client.responses.create(input="And another.", previous_response_id=second.id,
                                    truncation="auto", **GREEDY)
    text, tokens = chat(client, [{"role": "user", "content": USER},
                                 {"role": "assistant", "content": second.output_text},
                                 {"role": "user", "content": "And another."}])
    assert (third.output_text, third.usage.input_tokens) == (text, tokens)


def test_nothing_fits_beside_the_instructions(http):
    body = {"model": "tiny", "input": USER, "instructions": LONG, "truncation": "auto",
            "max_output_tokens": 10}
    error = http.post(R, json=body).json()["error"]
    assert error["code"] == "context_length_exceeded" and "instructions" in error["message"]


def test_disabled_truncation_refuses_a_long_input_by_its_size(http):
    body = {"model": "tiny", "input": "x " * 1_500_000, "max_output_tokens": 10}
    response = http.post(R, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]


@pytest.mark.parametrize("field,length,limit", [
    ("user", 257, "max_user_length"), ("prompt_cache_key", 257, "max_user_length"),
    ("safety_identifier", 65, "max_safety_identifier_length")])
def test_identifiers_are_bounded(http, field, length, limit):
    body = {"model": "tiny", "input": USER, "max_output_tokens": 2}
    response = http.post(R, json={**body, field: "u" * length})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and limit in error["message"]
    fine = http.post(R, json={**body, field: "u" * (length - 1)})
    assert fine.status_code == 200 and fine.json()[field] == "u" * (length - 1)
    if field == "user":
        for path, extra in (("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": USER}]}),
                            ("/v1/completions", {"prompt": USER})):
            refused = http.post(path, json={"model": "tiny", "max_tokens": 2, "user":
                                            "u" * length, **extra})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "user"


def test_the_store_is_bounded_in_bytes():
    entry = StoredResponse({"id": "x", "text": "a" * 1000}, ({"role": "user",
                                                              "content": "b" * 1000},))
    size = entry_size(entry)
    assert 2000 < size < 2300
    store = ResponseStore(100, max_bytes=3 * size)
    for name in "abcd":
        assert store.put(name, entry)
    assert len(store) == 3 and store.get("a") is None and store.bytes == 3 * size
    assert store.get("b") is not None  # (now the most recently used)
    store.put("e", entry)
    assert store.get("c") is None and store.get("b") is not None
    huge = StoredResponse({"id": "h", "text": "a" * (4 * size)}, ())
    assert not store.put("h", huge) and store.get("h") is None and len(store) == 3
    assert store.delete("b") and store.bytes == 2 * size
    with pytest.raises(ValueError, match="max_stored_response_bytes"):
        ResponseStore(10, max_bytes=0)


# ---- fit on the tiny tokenizer ---------------------------------------------------------------
def counted(tokenizer, seen: list | None = None) -> MessageCounter:
    counter = MessageCounter(tokenizer, longest_token_chars(tokenizer))
    if seen is not None:
        encode = counter.encode
        counter.encode = lambda text: seen.append(len(text)) or encode(text)
    return counter


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_fit_keeps_the_newest_whole_messages(tokenizer):
    messages = [{"role": "user", "content": "one two three"},
                {"role": "assistant", "content": "four five"},
                {"role": "user", "content": "six seven eight nine"}]
    counts = [tokens(tokenizer, m["content"]) for m in messages]
    assert fit(messages, sum(counts), counted(tokenizer)).messages == messages
    kept = fit(messages, counts[1] + counts[2], counted(tokenizer))
    # The assistant turn fits, but no user message would open the kept part before it.
    assert kept.messages == messages[2:] and kept.dropped == 2 and not kept.cut


def test_fit_cuts_only_a_newest_message_too_long_alone(tokenizer):
    text = " ".join(f"w{i}" for i in range(300))
    kept = fit([{"role": "user", "content": "old"}, {"role": "user", "content": text}], 40,
               counted(tokenizer))
    assert kept.cut and kept.dropped == 1 and len(kept.messages) == 1
    cut = kept.messages[0]["content"]
    assert text.endswith(cut.strip()) and 30 <= tokens(tokenizer, cut) <= 40


def test_a_text_too_long_to_fit_is_never_tokenized_whole(tokenizer):
    seen: list[int] = []
    counter = counted(tokenizer, seen)
    huge = "abc " * 500_000
    kept = fit([{"role": "user", "content": huge}, {"role": "user", "content": USER}], 100,
               counter)
    assert kept.messages == [{"role": "user", "content": USER}]
    kept = fit([{"role": "user", "content": huge}], 100, counted(tokenizer, seen))
    assert kept.cut and tokens(tokenizer, kept.messages[0]["content"]) <= 100
    assert max(seen) <= counter.bound(100) < len(huge) // 100
