"""What scripts/bench_on_device.py runs and how big: the model (Llama-3-8B's shape, or a
tiny Llama on the CPU) as a folder with no weights, the Plan of one run (engine arguments,
request and batch counts, the time budget and what each section needs of it), the Clock
that keeps it, and the Report that records what each section measured, skipped or failed;
the quantization_config of a checkpoint published quantized (FP8 blocks, W4A16, AWQ) sized
to a model's shape, so a folder with no weights serves that format too (also
scripts/bench_quantized.py).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=1,  # the built-in tokenizer's ids (ignore_eos anyway)
)
# Tiny: the same code path in seconds on a CPU. The vocabulary is twice the tokenizer's, as
# the 8B model's is larger than the built-in tokenizer's: ids the tokenizer lacks get decoded.
TINY = dict(LLAMA3_8B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, vocab_size=8192,
            max_position_embeddings=2048)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja")


QUANT_FORMATS = ("fp8", "w4a16", "awq")  # quantization_config's formats


def quant_group(config: dict) -> int:
    """The group (and block) size of a published-quantized format for this model shape: 128,
    as published, or the largest power of two below it that divides every projection's input
    and output size (the tiny model's 64-wide layers take 32)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    sizes = (config["hidden_size"], config["intermediate_size"],
             config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim)
    group = 128
    while group > 1 and any(size % group for size in sizes):
        group //= 2
    return group


def quantization_config(fmt: str, config: dict) -> dict:
    """config.json's quantization_config of a checkpoint published in `fmt` (QUANT_FORMATS),
    with groups / blocks of quant_group(config): fp8, DeepSeek-V3 / Qwen3-FP8's e4m3
    weights in blocks with dynamic activations; w4a16, compressed-tensors' pack-quantized
    symmetric int4 per group (16-bit activations); awq, AutoAWQ's GEMM int4 with zero points.
    The lm_head stays unquantized in all three."""
    group = quant_group(config)
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group, group]}
    if fmt == "w4a16":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": group}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": None}}}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}
    raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(QUANT_FORMATS)}")


class Plan:
    """Sizes of one run: the 8B model on an accelerator (full or --quick), or the tiny one."""

    def __init__(self, tiny: bool, quick: bool, args) -> None:
        self.tiny, self.quick = tiny, quick
        self.model_name = "tiny-llama" if tiny else "llama-3-8b-shaped"
        self.model_config = TINY if tiny else LLAMA3_8B
        if tiny:
            self.engine_args = dict(max_model_len=1024, max_num_seqs=8,
                                    max_num_batched_tokens=64)
            self.requests, self.decode_batches, self.decode_prompt = 12, (1, 4, 8), 32
            self.decode_steps, self.hf_requests, self.hf_batch = 8, 4, 4
            self.copy_bytes = 64 << 20
        else:
            self.engine_args = dict(max_model_len=2048, max_num_seqs=256,
                                    max_num_batched_tokens=2048)
            self.requests = 64 if quick else 256
            self.decode_batches, self.decode_prompt = (1, 32, 256), 128
            self.decode_steps = 16 if quick else 32
            self.hf_requests, self.hf_batch = (32, 32) if quick else (64, 32)
            self.copy_bytes = 2 << 30
        self.requests = args.requests or self.requests
        self.hf_requests = min(args.hf_requests or self.hf_requests, self.requests)
        self.hf_batch = args.hf_batch_size or self.hf_batch
        self.budget_s = args.max_seconds or (240.0 if quick else 600.0)
        # Seconds a section needs at least to be worth starting. The quantized section's
        # four engines (int8, fp8 and w4a16 weights, an fp8 KV cache) share theirs equally,
        # each compiling its buckets on first use: about 30 s each (--quick), 70 s (full).
        self.need = ({"throughput": 5, "decode": 5, "hf": 10, "torch": 10, "quantized": 20}
                     if tiny else
                     {"throughput": 20, "decode": 15 if quick else 30,
                      "hf": 30 if quick else 60, "torch": 45 if quick else 90,
                      "quantized": 120 if quick else 280})
        # The quantized engines' decode batches: the ones that show the bytes a step reads.
        self.quantized_batches = self.decode_batches[-2:]


class Clock:
    """Elapsed time since the start, the budget, and progress lines."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed

    @property
    def deadline(self) -> float:
        return self.start + self.budget_s

    def say(self, line: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {line}", flush=True)


class Report:
    """The JSON report, with the skipped and failed sections recorded and announced."""

    def __init__(self, plan: Plan, clock: Clock, **fields) -> None:
        self.plan, self.clock = plan, clock
        self.data: dict = {**fields, "skipped": {}, "errors": {}}

    def skip(self, section: str, why: str) -> None:
        self.data["skipped"][section] = why
        self.data.setdefault(section, {})["skipped"] = why
        self.clock.say(f"SKIPPED {section}: {why}")

    def fits(self, section: str, reserve: float = 0.0) -> bool:
        """Whether the budget leaves the time the section needs (beyond `reserve` seconds
        kept for a later section); if not, skip it."""
        need, left = self.plan.need[section], self.clock.left - reserve
        if left < need:
            kept = f" ({reserve:.0f} s kept for the torch backend)" if reserve else ""
            self.skip(section, f"{left:.0f} s of the {self.plan.budget_s:.0f} s budget left"
                               f"{kept}, the section needs about {need} s")
            return False
        return True

    def failed(self, section: str, err: Exception) -> None:
        why = f"{type(err).__name__}: {err}"
        self.data["errors"][section] = why
        self.data.setdefault(section, {})["error"] = why
        self.clock.say(f"FAILED {section}: {why}")


def write_model_folder(folder: pathlib.Path, config: dict) -> pathlib.Path:
    """config.json plus the built-in model's tokenizer files: a model folder with no weights
    (load_format="dummy" makes them on the device)."""
    import jaxserve

    source = jaxserve.default_model_path()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder
