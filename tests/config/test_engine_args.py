"""One EngineArgs for LLM(...) and the command line: vLLM's names, jaxserve's aliases, every
field a flag of `generate` and `serve`, TypeError for an unknown keyword."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.cli import build_parser
from jaxserve.config.engine_args import EngineArgs

SCRIPT = pathlib.Path(sys.executable).parent / "jaxserve"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
def test_every_field_is_a_flag_in_help(command):
    out = subprocess.run([str(SCRIPT), command, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for field in dataclasses.fields(EngineArgs):
        assert flag(field.name) in out.stdout, (command, field.name)
        for alias in field.metadata["aliases"]:
            assert flag(alias) in out.stdout, (command, alias)
    assert "--log-level" in out.stdout


def test_flags_and_aliases_parse_to_the_fields():
    parse = build_parser().parse_args
    args = EngineArgs.from_cli(parse([
        "serve", "--num-kv-blocks", "64", "--expert-parallel", "-tp", "2", "--dtype", "half",
        "--precompile", "lazy", "--compilation-cache-dir", "none", "--no-enable-prefix-caching"]))
    assert (args.num_gpu_blocks_override, args.enable_expert_parallel, args.tensor_parallel_size,
            args.dtype, args.precompile, args.compilation_cache_dir,
            args.enable_prefix_caching) == (64, True, 2, "half", False, None, False)
    args = EngineArgs.from_cli(parse(["generate", "--num-gpu-blocks-override", "32", "hi"]))
    assert args.num_gpu_blocks_override == 32 and args.precompile is None
    defaults = EngineArgs.from_cli(parse(["serve"]))
    assert defaults == EngineArgs()  # the flags' defaults are the dataclass's
    with pytest.raises(SystemExit):
        parse(["serve", "--precompile", "sometimes"])


def test_log_level_is_accepted_before_and_after_the_subcommand():
    parse = build_parser().parse_args
    assert parse(["serve", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parse(["--log-level", "WARNING", "serve"]).log_level == "WARNING"
    assert parse(["generate", "hi"]).log_level == "INFO"


def test_unknown_keywords_raise_type_error_naming_the_accepted_ones():
    with pytest.raises(TypeError, match="'max_num_sequences'.*max_num_seqs"):
        LLM(max_num_sequences=4)
    with pytest.raises(TypeError, match="both 'num_gpu_blocks_override' and its alias"):
        EngineArgs.from_kwargs(num_kv_blocks=8, num_gpu_blocks_override=8)
    assert EngineArgs.from_kwargs(expert_parallel=True).enable_expert_parallel is True


def test_vllm_names_are_accepted(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), num_gpu_blocks_override=64, enable_expert_parallel=False,
              dtype="half", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    config = llm.engine.config
    assert (config.cache.num_kv_blocks, config.parallel.expert_parallel, config.model.dtype) \
        == (64, False, "float16")
    assert llm.engine.runner.num_blocks == 64
    out = llm.generate("def f(x):", SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert EngineArgs.from_kwargs(dtype="float").engine_config(
        str(tiny_checkpoint), on_accelerator=False).model.dtype == "float32"
