"""`jaxserve bench serve`'s prompts, as vLLM's benchmark datasets: the tokenizer that counts
them, the random dataset (token-id sequences decoded to text, re-encoded to the length asked
for) and ShareGPT-format conversations read from a local JSON file (never downloaded).

The tokenizer is a local one (a model folder, the Hugging Face cache, or a Hub download when
--tokenizer names a Hub id), or else the server's own /tokenize and /detokenize routes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import random

import numpy as np

SHAREGPT_FORMAT = ('a JSON list of {"conversations": [{"from": "human", "value": PROMPT}, '
                   '{"from": "gpt", "value": ANSWER}, ...]} objects')
# vLLM's ShareGPT filter (datasets/utils.py is_valid_sequence)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
WORDS = ("def class return import self value list dict for while yield print data file name "
         "index count result error open close read write start stop the of and to in is it "
         "that with as on be at by this from or an").split()


@dataclasses.dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as this tokenizer counts them (the server's usage wins)
    expected_output_len: int
    request_id: str = ""


# ---- tokenizers ---------------------------------------------------------------------------
class LocalTokenizer:
    """A transformers tokenizer: what the datasets and the metrics need of it."""

    def __init__(self, tokenizer, name: str):
        self.tok, self.name = tokenizer, name
        self.vocab_size = tokenizer.vocab_size  # the base vocabulary, as vLLM samples it
        self.special_ids = set(tokenizer.all_special_ids)
        self.num_special = int(tokenizer.num_special_tokens_to_add())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class ServerTokenizer:
    """The server's /tokenize and /detokenize (jaxserve and vLLM have both): used when no
    local tokenizer is found. Its vocabulary is unknown, so random prompts are words."""

    vocab_size = None
    special_ids: set = set()

    def __init__(self, base_url: str, model: str, headers: dict, verify: bool = True):
        import httpx

        self.name = f"{base_url}/tokenize"
        self.model = model
        self.client = httpx.Client(base_url=base_url, headers=headers, timeout=60.0,
                                   verify=verify, trust_env=False)
        with_special = self._post("/tokenize", {"prompt": "a", "add_special_tokens": True})
        plain = self._post("/tokenize", {"prompt": "a", "add_special_tokens": False})
        self.num_special = len(with_special["tokens"]) - len(plain["tokens"])

    def _post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            response = self.client.post(path, json={"model": self.model, **body})
        except httpx.HTTPError as err:
            raise ValueError(f"{self.name}: {err}") from None
        if response.status_code != 200:
            raise ValueError(f"no local tokenizer, and the server's {path} answered "
                             f"HTTP {response.status_code}: pass --tokenizer")
        return response.json()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"prompt": text, "add_special_tokens": add_special_tokens}
        return list(self._post("/tokenize", body)["tokens"])

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": list(ids)})["prompt"]


def load_local_tokenizer(name: str, download: bool,
                         trust_remote_code: bool = False) -> LocalTokenizer | None:
    """name: a model folder, or a Hub id (from the Hugging Face cache; downloaded too when
    download is set). None if it cannot be found. Code from the folder or the Hub runs only
    with trust_remote_code."""
    if pathlib.Path(name).expanduser().is_dir() and not trust_remote_code:
        from jaxserve.inputs.tokenizer import load_tokenizer

        path = str(pathlib.Path(name).expanduser())
        return LocalTokenizer(load_tokenizer(path), path)
    if name.count("/") > 1 or name.startswith((".", "~", "/")):
        return None  # a path that is not here (a folder on the server's machine)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(pathlib.Path(name).expanduser()),
                                            trust_remote_code=trust_remote_code,
                                            local_files_only=not download)
    except Exception:  # any failure means: not available here
        return None
    return LocalTokenizer(tok, name)


# ---- random --------------------------------------------------------------------------------
def random_lengths(rng: np.random.Generator, count: int, input_len: int, output_len: int,
                   range_ratio: float, num_special: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's sampling: input lengths (less the tokenizer's special tokens) and output
    lengths uniform in [len * (1 - r), len * (1 + r)], outputs at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    real_input = max(0, input_len - num_special)
    in_low, in_high = math.floor(real_input * (1 - range_ratio)), math.ceil(
        real_input * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    return (rng.integers(in_low, in_high + 1, size=count),
            rng.integers(out_low, out_high + 1, size=count))


def sample_random(tokenizer, num_requests: int, input_len: int, output_len: int,
                  range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                  id_prefix: str = "") -> list[SampleRequest]:
    """vLLM's random dataset: one fixed random prefix of prefix_len tokens, then a run of
    consecutive vocabulary ids from a random offset; decoded, re-encoded and cut or topped
    up until the text encodes to the length asked for."""
    rng = np.random.default_rng(seed)
    in_lens, out_lens = random_lengths(rng, num_requests, input_len, output_len, range_ratio,
                                       tokenizer.num_special)
    if prefix_len + int(in_lens.min(initial=1)) < 1:
        raise ValueError("--random-input-len is too small for this tokenizer's special tokens")
    if tokenizer.vocab_size is None:
        allowed = None
        prefix = _words(rng, prefix_len)
    else:
        allowed = np.array(sorted(set(range(tokenizer.vocab_size)) - tokenizer.special_ids))
        prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    offsets = rng.integers(0, tokenizer.vocab_size or 1, size=num_requests)
    out = []
    for i in range(num_requests):
        if allowed is None:  # words, about a token each: tokenized by the server, then cut
            ids = tokenizer.encode(" ".join(prefix + _words(rng, int(in_lens[i]))),
                                   add_special_tokens=False)
            ids = ids[: prefix_len + int(in_lens[i])]
            prompt = tokenizer.decode(ids)
        else:
            inner = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
            prompt, ids = _to_length(tokenizer, prefix + inner, prefix_len + int(in_lens[i]),
                                     allowed, rng)
        out.append(SampleRequest(prompt, len(ids), int(out_lens[i]), f"{id_prefix}{i}"))
    return out


def _words(rng: np.random.Generator, count: int) -> list[str]:
    return [WORDS[k] for k in rng.integers(0, len(WORDS), size=count)]


def _to_length(tokenizer, ids: list[int], target: int, allowed: np.ndarray,
               rng: np.random.Generator, tries: int = 10) -> tuple[str, list[int]]:
    """Text that encodes (no special tokens) to target ids, as near as 10 tries get."""
    for _ in range(tries):
        prompt = tokenizer.decode(ids)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if len(ids) == target:
            break
        if len(ids) > target:
            ids = ids[:target]
        else:
            ids = ids + allowed[rng.integers(0, len(allowed), target - len(ids))].tolist()
    return tokenizer.decode(ids), ids


# ---- ShareGPT ------------------------------------------------------------------------------
def load_sharegpt(path: str | None) -> list[dict]:
    """The conversations of a local ShareGPT-format file with at least two turns; a clear
    ValueError for a missing, unreadable or malformed one."""
    if not path:
        raise ValueError("--dataset-name sharegpt reads a local file: pass --dataset-path "
                         f"FILE.json ({SHAREGPT_FORMAT}); nothing is downloaded")
    if "://" in path:
        raise ValueError(f"--dataset-path {path}: a local file only, not a URL (nothing is "
                         "downloaded)")
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--dataset-path {path}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"--dataset-path {path}: not valid JSON ({err}); expected "
                         f"{SHAREGPT_FORMAT}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected {SHAREGPT_FORMAT}, got a JSON "
                         f"{type(data).__name__}")
    entries = [entry for entry in data if isinstance(entry, dict)
               and isinstance(entry.get("conversations"), list)
               and len(entry["conversations"]) >= 2
               and all(isinstance(turn, dict) and isinstance(turn.get("value"), str)
                       for turn in entry["conversations"][:2])]
    if not entries:
        raise ValueError(f"--dataset-path {path}: no conversation with two turns; expected "
                         f"{SHAREGPT_FORMAT}")
    return entries


def sample_sharegpt(tokenizer, entries: list[dict], num_requests: int,
                    output_len: int | None = None, seed: int = 0, shuffle: bool = True,
                    oversample: bool = True, id_prefix: str = "") -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: the first turn is the prompt, the second's length (or
    output_len) the output; pairs shorter than 4 tokens, prompts over 1024 and pairs over
    2048 are skipped; too few left are drawn again (oversample) up to num_requests."""
    entries = list(entries)
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(entries)
    out: list[SampleRequest] = []
    for entry in entries:
        if len(out) >= num_requests:
            break
        prompt, answer = (turn["value"] for turn in entry["conversations"][:2])
        prompt_len = len(tokenizer.encode(prompt))
        new_output_len = (len(tokenizer.encode(answer)) if output_len is None else output_len)
        if not valid_pair(prompt_len, new_output_len, skip_output_check=output_len is not None):
            continue
        out.append(SampleRequest(prompt, prompt_len, new_output_len, f"{id_prefix}{len(out)}"))
    if not out:
        raise ValueError("no ShareGPT conversation fits (prompt and answer of 4 or more "
                         f"tokens, prompt <= {MAX_PROMPT_LEN}, both <= {MAX_TOTAL_LEN})")
    if oversample and len(out) < num_requests:
        extra = rng.choices(out, k=num_requests - len(out))
        out += [dataclasses.replace(r, request_id=f"{id_prefix}{len(out) + i}")
                for i, r in enumerate(extra)]
    return out


def valid_pair(prompt_len: int, output_len: int, skip_output_check: bool = False) -> bool:
    too_short = prompt_len < MIN_LEN or (not skip_output_check and output_len < MIN_LEN)
    return not (too_short or prompt_len > MAX_PROMPT_LEN
                or prompt_len + output_len > MAX_TOTAL_LEN)


def get_samples(args, tokenizer, entries: list[dict] | None = None) -> list[SampleRequest]:
    """args.dataset_name's requests (`jaxserve bench serve`'s flags); entries: the ShareGPT
    file's, when already loaded."""
    if args.dataset_name == "random":
        return sample_random(tokenizer, args.num_prompts, args.random_input_len,
                             args.random_output_len, args.random_range_ratio,
                             args.random_prefix_len, args.seed, args.request_id_prefix)
    entries = load_sharegpt(args.dataset_path) if entries is None else entries
    return sample_sharegpt(tokenizer, entries, args.num_prompts,
                           args.sharegpt_output_len, args.seed, not args.disable_shuffle,
                           not args.no_oversample, args.request_id_prefix)
