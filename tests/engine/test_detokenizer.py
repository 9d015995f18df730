"""Tests for jaxserve.engine.detokenizer: incremental text, UTF-8 hold-back, stop strings."""

import ast
import pathlib
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

from jaxserve.engine.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world. The quick brown fox jumps over the lazy dog. Stop here, or go on!",
    "abc STOX def STOP! ghi. Numbers 12345 and 67890; punctuation?! (brackets) [x] {y}.",
    "我们今天去公园散步，天气很好。中文分词测试，这是一个句子。你好世界！",
    "日本語のテキストも少し。한국어 텍스트도 조금.",
    "Emoji time 😀🎉🚀 and more 😀 text 👍🏽 ok ✨.",
] * 30
# Characters mostly absent from the corpus: byte-level BPE splits them into several tokens.
RARE = "龍鳳麒麟龘靐齉爩𠀀𝄞🦄🧬🪐👩‍👩‍👧é ü ß ñ"
POOL = "abcdefgh xyz .,!?\n" + "我们今天公园天气" + "😀🎉🚀👍🏽" + RARE


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE tokenizer (GPT-2 style) with chat special tokens."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def spm_tok():
    """A sentencepiece-style tokenizer: '▁' marks spaces, dropped at the start of a decode."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")


class ByteTokenizer(PreTrainedTokenizer):
    """A slow (pure Python) tokenizer: one token per UTF-8 byte."""

    @property
    def vocab_size(self):
        return 256

    def get_vocab(self):
        return {**{chr(i): i for i in range(256)}, **self.added_tokens_encoder}

    def _tokenize(self, text):
        return [chr(b) for b in text.encode()]

    def _convert_token_to_id(self, token):
        return ord(token)

    def _convert_id_to_token(self, index):
        return chr(index)

    def convert_tokens_to_string(self, tokens):
        data = b"".join(t.encode() if len(t) > 1 else bytes([ord(t)]) for t in tokens)
        return data.decode("utf-8", errors="replace")


class SpyTokenizer:
    """Delegates decode and records the length of every id list decoded."""

    def __init__(self, inner):
        self.inner = inner
        self.lengths = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def enc(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def special(tokenizer, name):
    return tokenizer.convert_tokens_to_ids(name)


def chunked(ids, rng, max_chunk):
    i = 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        yield ids[i:i + n]
        i += n


def stream(detok, chunks, last_stop_terminated=False):
    """Feeds chunks as a streaming server would; returns (deltas, stop string or None)."""
    chunks = list(chunks)
    deltas = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        stop = detok.update(chunk, stop_terminated=last and last_stop_terminated)
        finished = stop is not None or (last and last_stop_terminated)
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if finished:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


def test_tokenizer_splits_characters_across_tokens(tok):
    # The streaming tests below are only meaningful if tokens cut characters in pieces.
    ids = enc(tok, RARE)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.decode(ids) == RARE


@pytest.mark.parametrize("max_chunk", [1, 3, 8])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_stream_equals_full_decode(tok, max_chunk, with_prompt):
    rng = random.Random(max_chunk * 10 + with_prompt)
    for _ in range(40):
        text = "".join(rng.choice(POOL) for _ in range(rng.randint(1, 60)))
        ids = enc(tok, text)
        prompt = enc(tok, "<|im_start|>user\n你好 😀<|im_end|>") if with_prompt else []
        detok = IncrementalDetokenizer(tok, prompt)
        deltas, stop = stream(detok, chunked(ids, rng, max_chunk))
        assert stop is None
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
        assert detok.output_text == text
        assert detok.token_ids == ids
        for d in deltas:
            assert "\ufffd" not in d


@pytest.mark.parametrize("max_chunk", [1, 4])
def test_random_token_ids_equal_full_decode(tok, max_chunk):
    # Arbitrary ids give invalid UTF-8 too; whatever decode makes of it must come out whole,
    # including a trailing incomplete character, emitted as U+FFFD only once finished.
    rng = random.Random(max_chunk)
    vocab = range(len(SPECIALS), len(tok))
    for _ in range(60):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, [])
        deltas, _ = stream(detok, chunked(ids, rng, max_chunk))
        assert "".join(deltas) == tok.decode(ids)
        assert detok.output_text == tok.decode(ids)


def test_incomplete_character_is_held_until_completed(tok):
    ids = enc(tok, "a龍")
    assert len(ids) >= 3
    detok = IncrementalDetokenizer(tok, [])
    shown = []
    for i in ids[:-1]:
        detok.update([i], stop_terminated=False)
        shown.append(detok.get_next_output_text(finished=False, delta=True))
    assert "".join(shown) == "a"
    assert detok.output_text == "a"
    detok.update(ids[-1:], stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "龍"


def test_finishing_mid_character_emits_replacement(tok):
    ids = enc(tok, "x龍")[:-1]  # cut the last byte of 龍
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids, stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=False) == "x"
    final = detok.get_next_output_text(finished=True, delta=False)
    assert final == tok.decode(ids) and final.endswith("\ufffd")
    with pytest.raises(RuntimeError):
        detok.update(ids, stop_terminated=False)


def test_cost_per_update_does_not_grow(tok):
    rng = random.Random(0)
    text = "".join(rng.choice(POOL) for _ in range(3000))
    ids = enc(tok, text)
    spy = SpyTokenizer(tok)
    detok = IncrementalDetokenizer(spy, enc(tok, "a long prompt " * 20))
    for i in ids:
        detok.update([i], stop_terminated=False)
        assert text.startswith(detok.output_text)  # read every step, as a stream does
    assert detok.output_text == text
    assert max(spy.lengths) <= 16  # a full re-decode would reach len(ids) ~ 6000
    assert len(spy.lengths) <= 2 * len(ids)


def test_text_nobody_reads_is_decoded_once(tok):
    """Without stop strings, ids wait until the text is read (offline generation reads it
    once, at the end): then one decode of about the whole output, not one per token."""
    rng = random.Random(1)
    text = "".join(rng.choice(POOL) for _ in range(500))
    ids = enc(tok, text)
    spy = SpyTokenizer(tok)
    detok = IncrementalDetokenizer(spy, enc(tok, "a prompt"))
    for i in ids:
        detok.update([i], stop_terminated=False)
    assert spy.lengths == []
    assert detok.get_next_output_text(finished=True, delta=False) == text
    assert len(spy.lengths) <= 3 and sum(spy.lengths) <= len(ids) + 20


def byte_ids(tokenizer, data):
    """The byte-level BPE ids of each byte of `data`, one token per byte (GPT-2's byte-to-char
    map: printable bytes map to themselves, the others to chr(256 + n) in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    extra = iter(range(256, 512))
    char = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    return tokenizer.convert_tokens_to_ids([char[b] for b in data])


def test_byte_ids(tok):
    assert tok.decode(byte_ids(tok, "a 𝄞龍".encode())) == "a 𝄞龍"
    assert len(byte_ids(tok, "𝄞".encode())) == 4


@pytest.mark.parametrize("data", [b"\xbe", b"\xe9", b"\xe9\xbe", b"\xf0\x9f\x98"],
                         ids=["continuation", "lead", "truncated-3-byte", "truncated-4-byte"])
@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_never_completing_bytes_stay_linear(tok, data, stop):
    """Tokens that keep the text's tail an incomplete character forever (byte-fallback
    garbage) must not make every step decode the whole run: the window is advanced once more
    than a character's worth of tokens waits, and the text is still exactly a full decode."""
    ids = byte_ids(tok, data) * (8000 // len(data))
    spy = SpyTokenizer(tok)
    detok = IncrementalDetokenizer(spy, enc(tok, "a prompt"), stop=stop)
    deltas, _ = stream(detok, [[i] for i in ids])
    assert "".join(deltas) == detok.output_text == tok.decode(ids)
    assert set(detok.output_text) == {"\ufffd"}
    assert max(spy.lengths) <= 32  # one growing window would reach len(ids) = 8000
    assert sum(spy.lengths) <= 20 * len(ids)


def test_never_completing_bytes_read_once_stay_linear(tok):
    ids = byte_ids(tok, b"\xbe") * 8000
    spy = SpyTokenizer(tok)
    detok = IncrementalDetokenizer(spy, [])
    for i in ids[:4000]:
        detok.update([i], stop_terminated=False)
    assert detok.output_text == tok.decode(ids[:3999])  # the last byte is held back
    for i in ids[4000:]:
        detok.update([i], stop_terminated=False)
        detok.get_next_output_text(finished=False, delta=True)
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(ids)
    assert spy.lengths[:2] == [4000, 3999]  # the run read at once, and where to cut it
    assert max(spy.lengths[2:]) <= 32  # then short windows: that run is not kept as context


@pytest.mark.parametrize("one_chunk", [False, True])
def test_character_split_over_four_tokens_after_garbage_comes_out_whole(tok, one_chunk):
    # 20 waiting garbage tokens advance the window; the 4-byte 𝄞 after them, one byte per
    # token, must still come out as one character, never as U+FFFD.
    garbage = byte_ids(tok, b"\x80" * 20)
    char = byte_ids(tok, "𝄞".encode())
    ids = enc(tok, "ok ") + garbage + char + garbage + char + enc(tok, "!")
    detok = IncrementalDetokenizer(tok, [])
    chunks = [ids[:-6], *[[i] for i in ids[-6:]]] if one_chunk else [[i] for i in ids]
    deltas, _ = stream(detok, chunks)
    assert "".join(deltas) == tok.decode(ids) == "ok " + ("\ufffd" * 20 + "𝄞") * 2 + "!"


@pytest.mark.parametrize("max_chunk", [1, 5, 40])
def test_random_bytes_equal_full_decode(tok, max_chunk):
    """Long random runs of single-byte tokens (mostly invalid UTF-8, some whole characters)
    mixed with ordinary tokens: the stream must equal a full decode however it is chunked."""
    rng = random.Random(max_chunk)
    pieces = [b"\x80", b"\xbe", b"\xe9", b"\xf0", b"\x9f", b"\x98", b"a", "龍".encode(),
              "𝄞".encode()]
    for _ in range(30):
        ids = []
        for _ in range(rng.randint(1, 120)):
            if rng.random() < 0.1:
                ids += enc(tok, rng.choice(POOL))
            else:
                ids += byte_ids(tok, rng.choice(pieces))
        for stop in [(), ("zz",)]:
            detok = IncrementalDetokenizer(tok, enc(tok, "p"), stop=stop)
            deltas, _ = stream(detok, chunked(ids, rng, max_chunk))
            assert "".join(deltas) == detok.output_text == tok.decode(ids)


def test_left_context_from_prompt_keeps_leading_space(spm_tok):
    prompt = enc(spm_tok, "Hello")
    out = enc(spm_tok, "Hello world")[len(prompt):]
    assert spm_tok.decode(out) == "world"  # decoded alone, the leading space is lost
    detok = IncrementalDetokenizer(spm_tok, prompt)
    deltas, _ = stream(detok, [[i] for i in out])
    assert "".join(deltas) == " world"


def test_spm_stream_equals_full_decode(spm_tok):
    text = "The quick brown fox jumps over the lazy dog. 你好世界 😀!"
    ids = enc(spm_tok, text)
    detok = IncrementalDetokenizer(spm_tok, [])
    deltas, _ = stream(detok, [[i] for i in ids])
    assert "".join(deltas) == spm_tok.decode(ids) == text


def test_slow_tokenizer(tok):
    slow = ByteTokenizer(eos_token="<|im_end|>")
    text = "hé 中😀"
    ids = enc(slow, text) + [special(slow, "<|im_end|>")] + enc(slow, "!")
    detok = IncrementalDetokenizer(slow, enc(slow, "prompt "))
    deltas, _ = stream(detok, [[i] for i in ids])
    assert "".join(deltas) == text + "!"
    assert all("\ufffd" not in d for d in deltas)
    detok = IncrementalDetokenizer(slow, [], skip_special_tokens=False)
    deltas, _ = stream(detok, [[i] for i in ids])
    assert "".join(deltas) == text + "<|im_end|>!"


def _feed_one_by_one(detok, ids):
    """Returns (stop, index of the token whose update returned it)."""
    for n, i in enumerate(ids):
        stop = detok.update([i], stop_terminated=False)
        if stop is not None:
            return stop, n
    return None, None


def test_stop_string_spanning_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = enc(tok, text)
    stop_str = "fox jumps"
    assert all(stop_str not in tok.decode([i]) for i in ids)  # no single token holds it
    detok = IncrementalDetokenizer(tok, [], stop=[stop_str])
    stop, n = _feed_one_by_one(detok, ids)
    assert stop == stop_str
    assert tok.decode(ids[:n + 1]).startswith("The quick brown fox jumps")
    assert stop_str not in tok.decode(ids[:n])  # found at the token that completes it
    assert detok.output_text == "The quick brown "
    assert detok.get_next_output_text(finished=True, delta=False) == "The quick brown "


def test_include_stop_str_in_output(tok):
    ids = enc(tok, "The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(tok, [], stop=["fox jumps"], include_stop_str_in_output=True)
    deltas, stop = stream(detok, [[i] for i in ids])
    assert stop == "fox jumps"
    assert detok.output_text == "The quick brown fox jumps"
    assert "".join(deltas) == "The quick brown fox jumps"


@pytest.mark.parametrize("stops", [["lazy", "quick"], ["quick", "lazy"]])
@pytest.mark.parametrize("one_chunk", [False, True])
def test_earliest_stop_string_wins(tok, stops, one_chunk):
    ids = enc(tok, "The quick brown fox jumps over the lazy dog.")
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    if one_chunk:
        stop = detok.update(ids, stop_terminated=False)
    else:
        stop, _ = _feed_one_by_one(detok, ids)
    assert stop == "quick"
    assert detok.output_text == "The "


def test_overlapping_stop_strings_first_completed_wins(tok):
    # "xabc" starts first but "ab" is complete first; the result must not depend on chunking.
    ids = enc(tok, "1 xabc 2")
    for chunks in ([ids], [[i] for i in ids]):
        detok = IncrementalDetokenizer(tok, [], stop=["xabc", "ab"])
        _, stop = stream(detok, chunks)
        assert stop == "ab"
        assert detok.output_text == "1 x"


def test_text_after_stop_is_never_exposed(tok):
    text = "Hello world. Stop here, or go on!"
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["here"])
    assert detok.update(ids, stop_terminated=False) == "here"
    assert detok.output_text == "Hello world. Stop "
    assert detok.get_next_output_text(finished=False, delta=False) == "Hello world. St"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world. Stop "
    assert detok.get_next_output_text(finished=True, delta=True) == "Hello world. Stop "
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.token_ids == ids  # the ids themselves are all kept
    with pytest.raises(RuntimeError):
        detok.update(ids[:1], stop_terminated=False)


def test_partial_stop_match_is_held_back_then_released(tok):
    text = "abc STOX def STOP! ghi"
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, [], stop=["STOP!"])
    shown = ""
    held_sto = released_stox = False
    for i in ids:
        stop = detok.update([i], stop_terminated=False)
        if stop is not None:
            shown += detok.get_next_output_text(finished=True, delta=True)
            break
        shown += detok.get_next_output_text(finished=False, delta=True)
        # Exactly the last len("STOP!") - 1 characters are held back.
        assert shown == detok.output_text[:max(len(detok.output_text) - 4, 0)]
        assert detok.get_next_output_text(finished=False, delta=False) == shown
        if detok.output_text == "abc STO":  # could still become "STOP!"
            held_sto = shown == "abc"
        released_stox = released_stox or "STOX" in shown  # turned out not to be a stop
    assert stop == "STOP!"
    assert held_sto and released_stox
    assert shown == detok.output_text == "abc STOX def "


def test_stop_terminated_drops_last_token(tok):
    ids = enc(tok, "Hello world")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update(ids, stop_terminated=True) is None
    assert detok.output_text == tok.decode(ids[:-1]) != tok.decode(ids)
    assert detok.token_ids == ids
    with pytest.raises(RuntimeError):
        detok.update(ids[:1], stop_terminated=False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_by_eos(tok, include):
    eos = special(tok, "<|im_end|>")
    ids = enc(tok, "Hello world") + [eos]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                   include_stop_str_in_output=include)
    deltas, _ = stream(detok, [[i] for i in ids], last_stop_terminated=True)
    expected = "Hello world<|im_end|>" if include else "Hello world"
    assert "".join(deltas) == detok.output_text == expected


def test_stop_terminated_mid_character(tok):
    ids = enc(tok, "x龍")
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids, stop_terminated=True)
    # The stop token was the last byte of 龍: what is left decodes like tokenizer.decode does.
    assert detok.output_text == tok.decode(ids[:-1])
    assert detok.output_text.startswith("x\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = (enc(tok, "Hi") + [special(tok, "<|im_start|>")] + enc(tok, "there 😀")
           + [special(tok, "<|im_end|>")] + enc(tok, "!"))
    detok = IncrementalDetokenizer(tok, [special(tok, "<|im_start|>")], skip_special_tokens=skip)
    deltas, _ = stream(detok, [[i] for i in ids])
    expected = "Hithere 😀!" if skip else "Hi<|im_start|>there 😀<|im_end|>!"
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip) == expected


def test_stop_string_across_special_token_boundary(tok):
    ids = enc(tok, "ab") + [special(tok, "<|im_end|>")] + enc(tok, "cd")
    detok = IncrementalDetokenizer(tok, [], stop=["bc"])
    assert detok.update(ids, stop_terminated=False) == "bc"
    assert detok.output_text == "a"
    detok = IncrementalDetokenizer(tok, [], stop=["bc"], skip_special_tokens=False)
    assert detok.update(ids, stop_terminated=False) is None


@pytest.mark.parametrize("stop", ["", "abc", [""], ["ok", ""], [1], ["a\ufffd"], 5])
def test_bad_stop_raises(tok, stop):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=stop)


def test_bad_updates_raise(tok):
    detok = IncrementalDetokenizer(tok, [])
    with pytest.raises(ValueError):
        detok.update([], stop_terminated=True)
    with pytest.raises(ValueError):
        detok.update([1.5], stop_terminated=False)
    with pytest.raises(ValueError):
        detok.update([-1], stop_terminated=False)
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, ["a"])
    assert detok.update([], stop_terminated=False) is None
    assert detok.output_text == "" and detok.token_ids == []


def test_module_imports_only_the_standard_library():
    import jaxserve.engine.detokenizer as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots <= {"__future__", "collections", "functools", "operator"}


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_rust_fast_path_equals_tokenizer_decode(tok, skip_special_tokens):
    """Without space clean-up, decoding goes straight to the Rust backend; it must give
    exactly what tokenizer.decode gives (specials kept or skipped alike)."""
    from jaxserve.engine.detokenizer import _fast_decoder

    fast = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer,
                                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   clean_up_tokenization_spaces=False)
    assert _fast_decoder(fast, {"skip_special_tokens": skip_special_tokens}) is not None
    assert _fast_decoder(tok, {"skip_special_tokens": True}) is None or \
        not tok.clean_up_tokenization_spaces
    rng = random.Random(7 + skip_special_tokens)
    for _ in range(40):
        ids = [rng.randrange(len(fast)) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(fast, [], skip_special_tokens=skip_special_tokens)
        deltas, _ = stream(detok, chunked(ids, rng, 3))
        assert "".join(deltas) == fast.decode(ids, skip_special_tokens=skip_special_tokens)
