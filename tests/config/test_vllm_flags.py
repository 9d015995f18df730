"""Every `vllm serve` flag gets an answer: implemented, accepted with one WARNING where it has
no meaning here, or refused with a sentence naming what jaxserve lacks. Never argparse's
"unrecognized arguments" (exit 2), which ends a user's existing launch script on its first
line. The list is vLLM 0.33's `vllm serve --help`, by group, with a value for each flag that
takes one; the flags named in the issue are exercised for what they do further down (and in
tests/server/test_serve_flags.py against a running server)."""

from __future__ import annotations

import argparse
import json
import logging
import shlex

import pytest

from jaxserve.cli import build_parser, main
from jaxserve.cli.serve import check_serve_args
from jaxserve.config.engine_args import EngineArgs, human_int
from jaxserve.config.vllm_flags import FLAGS

OK, WARN, REFUSE = "ok", "warn", "refuse"

VLLM_SERVE_FLAGS = [
    # ---- top level
    ("--headless", REFUSE), ("--api-server-count 1", WARN), ("-asc 4", REFUSE),
    ("--config {config}", OK), ("--disable-log-stats", OK), ("--enable-log-requests", OK),
    ("--disable-log-requests", WARN),
    # ---- ModelConfig
    ("--model {model}", OK), ("--runner generate", OK), ("--runner pooling", OK),
    ("--convert none", OK), ("--convert embed", OK), ("--task generate", WARN),
    ("--task embed", REFUSE),
    ("--tokenizer {model}", OK), ("--tokenizer-mode auto", WARN),
    ("--tokenizer-mode mistral", REFUSE), ("--trust-remote-code", OK),
    ("--dtype bfloat16", OK), ("--dtype half", OK), ("--seed 7", OK),
    ("--hf-config-path x", REFUSE), ("--allowed-local-media-path /tmp", REFUSE),
    ("--allowed-media-domains a.example", REFUSE), ("--revision main", OK),
    ("--code-revision main", REFUSE), ("--tokenizer-revision main", OK),
    ("--max-model-len 32k", OK), ("--max-model-len 1024", OK), ("--quantization fp8", OK),
    ("-q awq", OK), ("--enforce-eager", WARN), ("--max-logprobs 5", OK),
    ("--logprobs-mode raw_logprobs", WARN), ("--logprobs-mode processed_logits", REFUSE),
    ("--disable-sliding-window", REFUSE), ("--disable-cascade-attn", WARN),
    ("--skip-tokenizer-init", REFUSE), ("--enable-prompt-embeds", REFUSE),
    ("--served-model-name a b", OK), ("--config-format auto", WARN),
    ("--config-format mistral", REFUSE), ("--hf-token", OK), ("--hf-token hf_abc", OK),
    ("--hf-overrides '{{}}'", REFUSE), ("--pooler-config '{{}}'", OK),
    ("--generation-config vllm", OK), ("--override-generation-config '{{}}'", REFUSE),
    ("--enable-sleep-mode", OK), ("--model-impl auto", WARN),
    ("--model-impl transformers", REFUSE), ("--override-attention-dtype float32", REFUSE),
    ("--logits-processors a.B", REFUSE), ("--io-processor-plugin p", REFUSE),
    ("--max-seq-len-to-capture 8192", WARN),
    # ---- LoadConfig
    ("--load-format safetensors", OK), ("--load-format auto", OK),
    ("--load-format dummy", OK), ("--download-dir /tmp/hf", OK),
    ("--safetensors-load-strategy eager", WARN), ("--model-loader-extra-config '{{}}'", REFUSE),
    ("--ignore-patterns original/**", WARN), ("--use-tqdm-on-load", WARN),
    ("--no-use-tqdm-on-load", WARN), ("--pt-load-map-location cpu", REFUSE),
    # ---- StructuredOutputsConfig / reasoning
    ("--reasoning-parser qwen3", OK), ("--structured-outputs-config '{{}}'", WARN),
    ("--guided-decoding-backend xgrammar", WARN),
    # ---- ParallelConfig
    ("--distributed-executor-backend mp", WARN), ("--distributed-executor-backend ray", REFUSE),
    ("-pp 1", WARN), ("--pipeline-parallel-size 2", REFUSE), ("-tp 2", OK),
    ("--tensor-parallel-size 4", OK), ("-dcp 1", WARN), ("-dcp 2", REFUSE), ("-dp 2", OK),
    ("--data-parallel-size 2", OK), ("-dpn 0", REFUSE), ("-dpr 2", REFUSE), ("-dpl 2", REFUSE),
    ("-dpa 10.0.0.1", REFUSE), ("-dpp 13345", REFUSE), ("-dpb mp", REFUSE),
    ("--data-parallel-hybrid-lb", REFUSE), ("--data-parallel-external-lb", REFUSE),
    ("--enable-expert-parallel", OK), ("--enable-eplb", REFUSE), ("--eplb-config '{{}}'", REFUSE),
    ("--expert-placement-strategy linear", WARN),
    ("--expert-placement-strategy round_robin", REFUSE),
    ("--max-parallel-loading-workers 4", WARN), ("--ray-workers-use-nsight", REFUSE),
    ("--disable-custom-all-reduce", WARN), ("--worker-cls a.B", REFUSE),
    ("--worker-extension-cls a.B", REFUSE), ("--enable-dbo", REFUSE),
    ("--all2all-backend naive", WARN), ("--enable-multimodal-encoder-data-parallel", REFUSE),
    # ---- CacheConfig
    ("--block-size 32", OK), ("--gpu-memory-utilization 0.85", OK),
    ("--kv-cache-memory-bytes 8G", OK), ("--swap-space 4", WARN), ("--kv-cache-dtype fp8", OK),
    ("--num-gpu-blocks-override 1024", OK), ("--enable-prefix-caching", OK),
    ("--no-enable-prefix-caching", OK), ("--prefix-caching-hash-algo sha256", WARN),
    ("--cpu-offload-gb 0", WARN), ("--cpu-offload-gb 8", REFUSE),
    ("--calculate-kv-scales", WARN), ("--kv-sharing-fast-prefill", REFUSE),
    ("--mamba-cache-dtype auto", REFUSE), ("--mamba-ssm-cache-dtype auto", REFUSE),
    ("--kv-offloading-size 8", REFUSE), ("--kv-offloading-backend native", REFUSE),
    # ---- MultiModalConfig
    ("""--limit-mm-per-prompt '{{"image":0}}'""", WARN),
    ("""--limit-mm-per-prompt '{{"image":2}}'""", REFUSE),
    ("--media-io-kwargs '{{}}'", REFUSE), ("--mm-processor-kwargs '{{}}'", REFUSE),
    ("--mm-processor-cache-gb 0", WARN), ("--disable-mm-preprocessor-cache", WARN),
    ("--mm-encoder-tp-mode data", WARN), ("--interleave-mm-strings", REFUSE),
    ("--skip-mm-profiling", WARN),
    # ---- LoRAConfig
    # (the LoRA sizes without --enable-lora would be ignored: refused instead)
    ("--enable-lora", OK), ("--lora-modules a=/tmp/a", REFUSE),
    ("--enable-lora --lora-modules a=/tmp/a", OK), ("--max-loras 4", REFUSE),
    ("--enable-lora --max-loras 4", OK), ("--max-lora-rank 16", OK),
    ("--max-cpu-loras 8", REFUSE), ("--lora-dtype auto", WARN),
    ("--lora-dtype float16", REFUSE), ("--fully-sharded-loras", REFUSE),
    ("--enable-lora-bias", REFUSE),
    ("--default-mm-loras '{{}}'", REFUSE),
    # ---- ObservabilityConfig
    ("--show-hidden-metrics-for-version 0.32", WARN),
    ("--otlp-traces-endpoint http://collector:4317", REFUSE),
    ("--collect-detailed-traces all", REFUSE), ("--kv-cache-metrics", WARN),
    # ---- SchedulerConfig
    ("--max-num-batched-tokens 8k", OK), ("--max-num-seqs 64", OK),
    ("--max-num-partial-prefills 1", WARN), ("--max-num-partial-prefills 4", REFUSE),
    ("--max-long-partial-prefills 1", WARN), ("--long-prefill-token-threshold 0", WARN),
    ("--long-prefill-token-threshold 512", REFUSE), ("--cuda-graph-sizes 1 2 4", WARN),
    ("--scheduling-policy priority", OK), ("--enable-chunked-prefill", WARN),
    ("--no-enable-chunked-prefill", REFUSE), ("--disable-chunked-mm-input", WARN),
    ("--scheduler-cls a.B", REFUSE), ("--disable-hybrid-kv-cache-manager", OK),
    ("--async-scheduling", OK), ("--stream-interval 1", WARN), ("--stream-interval 4", REFUSE),
    # ---- VllmConfig
    ("""--speculative-config '{{"method":"ngram","num_speculative_tokens":3}}'""", OK),
    ("--kv-transfer-config '{{}}'", REFUSE), ("--kv-events-config '{{}}'", REFUSE),
    ("--compilation-config '{{}}'", WARN), ("-O3", WARN), ("--additional-config '{{}}'", REFUSE),
    # ---- Frontend
    ("--host 0.0.0.0", OK), ("--port 8001", OK), ("--uds /tmp/s.sock", REFUSE),
    ("--uvicorn-log-level warning", OK), ("--disable-uvicorn-access-log", OK),
    ("--disable-access-log-for-endpoints /health,/metrics", OK), ("--allow-credentials", OK),
    ("--allowed-origins '[\"*\"]'", OK), ("--allowed-methods '[\"GET\",\"POST\"]'", OK),
    ("--allowed-headers '[\"*\"]'", OK), ("--api-key k1", OK), ("--ssl-certfile {cert} --ssl-keyfile {key}", OK),
    ("--ssl-certfile {cert}", OK), ("--ssl-certfile {cert} --ssl-ca-certs {cert} --ssl-cert-reqs 2", OK),
    ("--ssl-cert-reqs 0", OK), ("--ssl-keyfile {key}", REFUSE),
    ("--enable-ssl-refresh", REFUSE), ("--ssl-ciphers ECDHE-RSA-AES256-GCM-SHA384", REFUSE),
    ("--root-path /llm", OK), ("--middleware a.b", REFUSE), ("--enable-request-id-headers", OK),
    ("--disable-fastapi-docs", OK), ("--h11-max-incomplete-event-size 4M", OK),
    ("--h11-max-header-count 256", REFUSE), ("--enable-offline-docs", WARN),
    ("--chat-template '{{{{ messages }}}}'", OK), ("--chat-template-content-format auto", WARN),
    ("--chat-template-content-format openai", REFUSE), ("--trust-request-chat-template", OK),
    ("""--default-chat-template-kwargs '{{"enable_thinking":false}}'""", OK),
    ("--response-role assistant", WARN), ("--response-role bot", REFUSE),
    ("--return-tokens-as-token-ids", OK), ("--enable-auto-tool-choice --tool-call-parser hermes", OK),
    ("--exclude-tools-when-tool-choice-none", OK), ("--tool-parser-plugin p.py", REFUSE),
    ("--tool-server demo", REFUSE), ("--log-config-file {logconf}", OK), ("--max-log-len 100", OK),
    ("--enable-prompt-tokens-details", WARN), ("--enable-server-load-tracking", REFUSE),
    ("--enable-force-include-usage", OK), ("--enable-tokenizer-info-endpoint", REFUSE),
    ("--enable-log-requests --enable-log-outputs", OK), ("--log-error-stack", WARN),
    ("--tokens-only", REFUSE), ("--enable-per-request-metrics", REFUSE),
    ("--fingerprint-mode none", WARN), ("--fingerprint-value x", WARN),
    ("--disable-frontend-multiprocessing", WARN), ("--data-parallel-supervisor-port 9256", REFUSE),
    ("--cohere-is-reasoning-model", WARN), ("--cohere-format cmd4", WARN),
    ("--enable-flash-late-interaction", WARN), ("--limit-concurrency 64", OK),
]


@pytest.fixture
def files(tmp_path):
    from support.tls import certificate

    cert, key, _ = certificate(tmp_path)
    logconf = tmp_path / "logging.json"
    logconf.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 1k\nserved-model-name: [a, b]\n")
    return dict(cert=cert, key=key, logconf=logconf, config=config)


def _argv(flags: str, files: dict, model) -> list[str]:
    return shlex.split(flags.format(model=model, **files))


@pytest.mark.parametrize("flags,outcome", VLLM_SERVE_FLAGS, ids=[f for f, _ in VLLM_SERVE_FLAGS])
def test_every_vllm_serve_flag_is_answered(flags, outcome, files, tiny_checkpoint, caplog,
                                           monkeypatch):
    """Parsed (never "unrecognized"), then: OK gives no warning and a valid server and engine
    configuration; WARN exactly one WARNING naming the flag; REFUSE a ValueError naming it
    and saying why, before anything loads."""
    from jaxserve.config.config_file import expand_config

    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parser = build_parser()
    argv, _ = expand_config(["serve", *_argv(flags, files, tiny_checkpoint)], parser)
    args = parser.parse_args(argv)
    serve = _subparser(parser, "serve")
    names = serve._option_string_actions[shlex.split(flags)[0][:2] if flags.startswith("-O")
                                         else shlex.split(flags)[0]].option_strings
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        if outcome == REFUSE:
            with pytest.raises(ValueError) as err:
                check_serve_args(args)
            message = str(err.value)
            assert any(message.startswith(name) for name in names), message
            assert len(message) > len(names[0]) + 30, message  # a reason, not just the name
            return
        check_serve_args(args)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if outcome == WARN:
        assert len(warnings) == 1 and "ignored" in warnings[0], warnings
        assert any(warnings[0].startswith(name) for name in names), warnings
        return
    assert warnings == []
    engine_args = EngineArgs.from_cli(args)
    if any(word in flags for word in _MODEL_DEPENDENT):
        return  # what the tiny checkpoint refuses (a quantized format, a longer context)
    config = engine_args.engine_config(str(tiny_checkpoint), on_accelerator=True)
    assert config.model.max_model_len > 0


# OK flags whose engine configuration depends on the model or the Hub (exercised below or
# in tests/config/test_model_path.py): the tiny checkpoint is not quantized, holds 512 positions,
# is no MoE and is a local folder.
_MODEL_DEPENDENT = ("--quantization", "-q ", "32k", "--revision", "--tokenizer-revision",
                    "--enable-expert-parallel")


def _subparser(parser, command: str):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                ).choices[command]


def test_the_walk_covers_every_answered_flag_and_only_vllms():
    """Each flag of config/vllm_flags.py is on the list, and the list has no flag that
    jaxserve does not parse."""
    walked = {shlex.split(f)[0].split("=")[0] for f, _ in VLLM_SERVE_FLAGS}
    walked |= {"-O"} if "-O3" in walked else set()
    for flag in FLAGS:
        assert set(flag.flags) & walked, flag.flags
    known = set(_subparser(build_parser(), "serve")._option_string_actions)
    assert {f for f in walked if f != "-O3"} <= known | {"-O3"}


def test_sizes_take_vllms_suffixes():
    assert human_int("32k") == 32000 and human_int("32K") == 32768
    assert human_int("25.6k") == 25600 and human_int("1M") == 2**20 and human_int("2g") == 2e9
    assert human_int("8GiB") == 8 * 2**30 and human_int("8GB") == 8 * 10**9
    assert human_int("4096") == 4096
    for bad in ("32q", "1.5", "0.0001k", "", "k"):
        with pytest.raises(argparse.ArgumentTypeError):
            human_int(bad)
    args = build_parser().parse_args(["serve", "--max-model-len", "2K",
                                      "--kv-cache-memory-bytes", "1G",
                                      "--max-num-batched-tokens", "1k"])
    engine = EngineArgs.from_cli(args)
    assert (engine.max_model_len, engine.kv_cache_memory_bytes,
            engine.max_num_batched_tokens) == (2048, 2**30, 1000)


def test_version_and_help_groups(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("jaxserve ")
    assert main(["serve", "--help=listgroup"]) == 0
    groups = capsys.readouterr().out
    for title in ("ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig",
                  "Frontend", "Logging", "gRPC"):
        assert f"  {title}\n" in groups
    assert main(["serve", "--help=CacheConfig"]) == 0
    cache = capsys.readouterr().out
    assert "--block-size" in cache and "--port" not in cache
    assert main(["serve", "--help=ssl"]) == 0
    assert "--ssl-certfile" in capsys.readouterr().out


def test_config_file_flags_lose_to_the_command_line(tmp_path, tiny_checkpoint, capsys):
    from jaxserve.config.config_file import expand_config

    parser = build_parser()
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"model: {tiny_checkpoint}\nmax_model_len: 2k\nenable-prefix-caching: "
                         "false\nserved-model-name: [x, y]\nspeculative-config: {method: "
                         "ngram, num_speculative_tokens: 2}\nport: 9000\n")
    argv, model = expand_config(["serve", "--config", str(yaml_file), "--port", "9100"],
                                parser)
    args = parser.parse_args(argv)
    assert model == str(tiny_checkpoint)
    assert (args.max_model_len, args.enable_prefix_caching, args.served_model_name,
            args.port) == (2000, False, ["x", "y"], 9100)
    assert json.loads(args.speculative_config)["num_speculative_tokens"] == 2
    yaml_file.write_text("max-model-lenn: 4\n")
    assert main(["serve", "--config", str(yaml_file)]) == 2
    assert "unknown option 'max-model-lenn'" in capsys.readouterr().err
    yaml_file.write_text("- a\n- b\n")
    assert main(["serve", f"--config={yaml_file}"]) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_max_logprobs_is_the_request_limit(tiny_checkpoint):
    config = EngineArgs(max_logprobs=5).engine_config(str(tiny_checkpoint),
                                                      on_accelerator=False)
    assert config.limits.max_logprobs == 5
    assert config.limits.max_prompt_logprobs == 5
    with pytest.raises(ValueError, match="max_logprobs must be in 0..20"):
        EngineArgs(max_logprobs=-1).engine_config(str(tiny_checkpoint), on_accelerator=False)


def test_load_format_safetensors_reads_the_folder_and_others_are_refused(tiny_checkpoint):
    config = EngineArgs(load_format="safetensors").engine_config(str(tiny_checkpoint),
                                                                 on_accelerator=False)
    assert config.model.load_format == "safetensors"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "gguf"])


# ---- the configuration file is an input surface: fuzzed --------------------------------
_KEYS = ["max-model-len", "max_num_seqs", "port", "served-model-name", "enable-prefix-caching",
         "speculative-config", "api-key", "enforce-eager", "model", "dtype", "unknown-key",
         "config", "help", "allowed-origins", "stop"]


def test_fuzzed_config_files_end_in_a_message(tmp_path, capsys):
    """Any YAML document (or bytes) as --config: the flags parse, or a ValueError names the
    file's problem, or argparse's usage error names the flag (exit 2); nothing else."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    import yaml

    from jaxserve.config.config_file import expand_config

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(
        allow_nan=True), st.text(max_size=12))
    values = st.recursive(scalars, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
        max_leaves=6)
    documents = st.one_of(
        st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.text(max_size=8)), values,
                        max_size=5).map(lambda d: yaml.safe_dump(d)),
        st.binary(max_size=64).map(lambda b: b.decode("latin-1")), values.map(yaml.safe_dump))
    path = tmp_path / "c.yaml"
    parser = build_parser()

    @hypothesis.settings(max_examples=80, deadline=None, database=None, derandomize=True)
    @hypothesis.given(documents)
    def check(text):
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        try:
            argv, _ = expand_config(["serve", "--config", str(path)], parser)
            parser.parse_args(argv)
        except ValueError as err:
            assert str(err)
        except SystemExit as done:
            assert done.code == 2

    check()
