"""`jaxserve bench serve`: vLLM's flag names and defaults, the random and ShareGPT datasets
(a local file, its errors found before any request), the metrics and table under vLLM's
names, the plot and its missing-matplotlib error; and runs against a real `jaxserve serve` of
the built-in model (about 20 s to start cold, 10 s warm): a sweep of two concurrency levels
through the command (result JSON and PNG), and chat completions of a ShareGPT file through
scripts/bench_serving.py."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import pathlib
import re
import sys

import pytest

from jaxserve.benchmarks.serve.client import RequestOutput, arrival_times
from jaxserve.benchmarks.serve.datasets import (
    LocalTokenizer,
    load_sharegpt,
    sample_random,
    sample_sharegpt,
)
from jaxserve.benchmarks.serve.report import (
    calculate_metrics,
    plot_sweep,
    print_result,
    result_dict,
)
from jaxserve.benchmarks.serve.run import check_args, sweep_points
from jaxserve.cli import main as bench_main
from jaxserve.cli.bench import add_bench_parser
from jaxserve.config.model_path import default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
CLOSED_PORT = "9"  # discard: nothing listens; any request would fail differently

# `vllm bench serve` command lines of its docs and CI, flag for flag
VLLM_COMMAND = (
    "--backend openai --base-url http://10.1.2.3:8000 --endpoint /v1/completions "
    "--model meta-llama/Llama-3.1-8B-Instruct --tokenizer meta-llama/Llama-3.1-8B-Instruct "
    "--served-model-name llama --dataset-name random --num-prompts 200 "
    "--random-input-len 512 --random-output-len 64 --random-range-ratio 0.1 "
    "--random-prefix-len 16 --request-rate 8 --burstiness 0.5 --max-concurrency 16 "
    "--seed 7 --ignore-eos --temperature 0 --top-p 0.9 --top-k 20 --percentile-metrics "
    "ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir out "
    "--result-filename r.json --disable-tqdm --header x-a=1 x-b=2 --ready-check-timeout-sec 30 "
    "--num-warmups 2 --label run --metadata tp=1 --goodput ttft:500 tpot:50 --save-detailed "
    "--host 0.0.0.0 --port 9000 --sharegpt-output-len 32 --dataset-path x.json "
    "--logprobs 1 --min-p 0.1 --repetition-penalty 1.1 --request-id-prefix r- "
    "--tokenizer-mode auto --trust-remote-code --append-result")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxserve")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "serve", *argv])


@pytest.fixture(scope="module")
def tokenizer():
    from jaxserve.inputs.tokenizer import load_tokenizer

    path = str(default_model_path())
    return LocalTokenizer(load_tokenizer(path), path)


def test_parses_vllm_flags_and_defaults():
    args = parse(VLLM_COMMAND.split())
    assert (args.command, args.bench_command) == ("bench", "serve") and callable(args.func)
    assert args.base_url == "http://10.1.2.3:8000" and args.max_concurrency == "16"
    assert (args.random_input_len, args.random_output_len, args.random_prefix_len) == (512, 64,
                                                                                        16)
    assert args.random_range_ratio == 0.1 and args.request_rate == "8"
    assert args.burstiness == 0.5 and args.top_k == 20 and args.header == ["x-a=1", "x-b=2"]
    assert args.goodput == ["ttft:500", "tpot:50"] and args.metadata == ["tp=1"]
    defaults = parse([])  # vLLM's defaults
    assert (defaults.backend, defaults.host, defaults.port, defaults.dataset_name) == (
        "openai", "127.0.0.1", 8000, "random")
    assert (defaults.num_prompts, defaults.random_input_len, defaults.random_output_len,
            defaults.random_range_ratio, defaults.random_prefix_len, defaults.seed) == (
        1000, 1024, 128, 0.0, 0, 0)
    assert math.isinf(float(defaults.request_rate)) and defaults.burstiness == 1.0
    assert defaults.metric_percentiles == "99" and defaults.max_concurrency is None
    assert defaults.ready_check_timeout_sec == 0 and defaults.temperature is None
    with pytest.raises(SystemExit):
        parse(["--backend", "tgi"])


def test_checked_flags(tmp_path):
    plan = check_args(parse(["--base-url", "http://h:8000/v1/", "--header", "k=v",
                             "--api-key", "sk", "--temperature", "0", "--extra-body",
                             '{"top_k": 5}', "--max-concurrency", "1,4,16"]))
    assert plan.api_url == "http://h:8000/v1/completions" and plan.trust_env
    assert plan.headers == {"k": "v", "Authorization": "Bearer sk"}
    assert plan.extra_body == {"temperature": 0.0, "top_k": 5}
    assert plan.points == [(1, math.inf), (4, math.inf), (16, math.inf)]
    assert plan.axis == "max concurrency" and plan.selected == ["ttft", "tpot", "itl", "e2el"]
    chat = check_args(parse(["--backend", "openai-chat", "--host", "::1", "--port", "81"]))
    assert chat.api_url == "http://[::1]:81/v1/chat/completions" and not chat.trust_env
    assert sweep_points("2", "1,2,inf") == ([(2, 1.0), (2, 2.0), (2, math.inf)],
                                            "request rate (req/s)")
    for argv, message in (
            (["--max-concurrency", "1,2", "--request-rate", "1,2"], "not both"),
            (["--max-concurrency", "0"], ">= 1"), (["--max-concurrency", "1.5"], "whole"),
            (["--backend", "openai-chat", "--endpoint", "/v1/completions"],
             "not a chat completions path"),
            (["--endpoint", "/v1/chat/completions"], "not a completions path"),
            (["--dataset-path", "x.json"], "--dataset-name sharegpt"),
            (["--percentile-metrics", "ttft,foo"], "unknown foo"),
            (["--goodput", "itl:5"], "KEY is one of"), (["--header", "novalue"], "KEY=VALUE"),
            (["--random-range-ratio", "1"], "[0, 1)"), (["--base-url", "ftp://h"], "http")):
        with pytest.raises(ValueError, match=re.escape(message)):
            check_args(parse(argv))


def test_random_dataset_lengths(tokenizer):
    assert tokenizer.num_special == 1  # the built-in tokenizer adds a BOS
    fixed = sample_random(tokenizer, 6, input_len=33, output_len=9, seed=3, id_prefix="r-")
    assert [r.request_id for r in fixed] == [f"r-{i}" for i in range(6)]
    assert {r.expected_output_len for r in fixed} == {9}
    for r in fixed:  # 33 less the BOS the server adds, as vLLM counts them
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len == 32
    assert len({r.prompt for r in fixed}) == 6
    again = sample_random(tokenizer, 6, input_len=33, output_len=9, seed=3, id_prefix="r-")
    assert [r.prompt for r in again] == [r.prompt for r in fixed]  # seeded
    ranged = sample_random(tokenizer, 40, input_len=21, output_len=10, range_ratio=0.5,
                           prefix_len=8, seed=1)
    assert all(8 + 10 <= r.prompt_len <= 8 + 30 for r in ranged)
    assert all(5 <= r.expected_output_len <= 15 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5 and len({r.expected_output_len
                                                             for r in ranged}) > 3
    prefixes = {tuple(tokenizer.encode(r.prompt, add_special_tokens=False)[:6]) for r in ranged}
    assert len(prefixes) == 1  # one shared random prefix


def write_sharegpt(path: pathlib.Path) -> pathlib.Path:
    entries = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Write a function that returns the number {i} twice."},
        {"from": "gpt", "value": f"def f():\n    return {i}, {i}  # the number, twice"}]}
        for i in range(3)]
    entries += [{"id": "one turn", "conversations": [{"from": "human", "value": "hi"}]},
                {"id": "short", "conversations": [{"from": "human", "value": "hi"},
                                                  {"from": "gpt", "value": "yo"}]}]
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt_file(tokenizer, tmp_path):
    entries = load_sharegpt(str(write_sharegpt(tmp_path / "sg.json")))
    assert len(entries) == 4  # the one-turn entry is dropped on load
    sampled = sample_sharegpt(tokenizer, entries, 3, shuffle=False)
    assert len(sampled) == 3 and "number 0" in sampled[0].prompt  # "short" is filtered out
    answer = entries[0]["conversations"][1]["value"]
    assert sampled[0].expected_output_len == len(tokenizer.encode(answer))
    assert sampled[0].prompt_len == len(tokenizer.encode(sampled[0].prompt))
    fixed = sample_sharegpt(tokenizer, entries, 7, output_len=5, seed=1)
    assert len(fixed) == 7 and {r.expected_output_len for r in fixed} == {5}  # oversampled
    assert len({r.request_id for r in fixed}) == 7
    assert len(sample_sharegpt(tokenizer, entries, 7, oversample=False)) == 3


@pytest.mark.parametrize("content,message", [
    (None, "no such file"), ("{not json", "not valid JSON"), ('{"a": 1}', "got a JSON dict"),
    ('[{"conversations": [{"value": "only one"}]}]', "no conversation with two turns"),
])
def test_bad_sharegpt_file_is_a_clear_error_before_any_request(tmp_path, capsys, content,
                                                               message):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    rc = bench_main(["bench", "serve", "--port", CLOSED_PORT, "--dataset-name", "sharegpt",
                     "--dataset-path", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and f"--dataset-path {path}" in err and message in err, err
    assert "ShareGPT" in err or "conversations" in err or "no such file" in err
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_sharegpt(None)
    with pytest.raises(ValueError, match="not a URL"):
        load_sharegpt("https://huggingface.co/datasets/x/ShareGPT.json")


def test_plot_without_matplotlib_fails_first(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    rc = bench_main(["bench", "serve", "--port", CLOSED_PORT, "--max-concurrency", "1,2",
                     "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install matplotlib" in err, err
    assert "model list" not in err  # nothing was sent: the flags failed first


def output(start: float, ttft: float, gaps: list[float], tokens: int = 0,
           prompt: int = 10) -> RequestOutput:
    return RequestOutput(success=True, start_time=start, ttft=ttft, itl=gaps,
                         latency=ttft + sum(gaps), output_tokens=tokens, prompt_len=prompt,
                         generated_text="x" * (len(gaps) + 1))


def test_metrics_table_json_and_plot(tmp_path):
    outputs = [output(0.0, 0.1, [0.02] * 4, tokens=5), output(0.0, 0.3, [0.04] * 2, tokens=3),
               RequestOutput(error="HTTP 500: boom", prompt_len=10)]
    m = calculate_metrics(outputs, duration=2.0, goodput={"ttft": 200})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 20, 8)
    assert m.output_throughput == 4.0 and m.request_throughput == 1.0
    assert m.request_goodput == 0.5  # only the first meets TTFT <= 200 ms
    assert m.max_concurrent_requests == 2 and m.max_output_tokens_per_s == 8
    assert m.series["tpot"] == pytest.approx([0.02, 0.04])
    result = result_dict(m, outputs, 2.0, ["ttft", "tpot", "itl", "e2el"], [50.0, 99.0],
                         goodput=True, detailed=True)
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                "p99_ttft_ms", "p50_tpot_ms", "mean_itl_ms", "p99_e2el_ms", "input_lens",
                "output_lens", "ttfts", "itls", "errors"):
        assert key in result, key
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_e2el_ms"] == pytest.approx(280.0)  # 180 and 380
    assert result["output_lens"] == [5, 3, 0]
    table = io.StringIO()
    print_result({**result, "max_concurrency": 4, "request_rate": "inf"}, ["ttft", "e2el"],
                 [50.0, 99.0], [], file=table)
    text = table.getvalue()
    for line in ("Successful requests:                     2", "Benchmark duration (s):",
                 "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
                 "Output token throughput (tok/s):", "Total token throughput (tok/s):",
                 "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Mean E2EL (ms):",
                 "Maximum request concurrency:", "Request goodput (req/s):"):
        assert line in text, line
    assert "TPOT" not in text  # not selected
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    from jaxserve.benchmarks.serve.report import plot_point

    points = [plot_point(m, str(c), 99.0) for c in (1, 2)]
    plot_sweep(points, str(tmp_path / "sweep.png"), "max concurrency", "test", 99.0)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG


def test_arrival_times():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_times(50, 10.0, seed=1)
    assert poisson[-1] == pytest.approx(5.0) and poisson == sorted(poisson)
    assert arrival_times(50, 10.0, seed=1) == poisson


def load_script():
    spec = importlib.util.spec_from_file_location("bench_serving",
                                                  ROOT / "scripts" / "bench_serving.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_script_parses_the_command_flags():
    args = load_script().build_parser().parse_args(
        ["--launch-model", "--server-args", "--max-num-seqs 8", "--max-concurrency", "1,2",
         "--random-input-len", "16", "--plot", "x.png"])
    assert args.launch_model == "" and args.max_concurrency == "1,2" and args.plot == "x.png"


# ---- against a real server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def builtin_server(tmp_path_factory):
    """`jaxserve serve` of the built-in model on a free loopback port, small buckets."""
    from jaxserve.benchmarks.local_server import (
        PYTHON_CLI,
        free_port,
        serve_command,
        start_server,
        stop_server,
        wait_healthy,
    )

    port = free_port()
    cmd = serve_command(PYTHON_CLI, port, None, ["--max-num-seqs", "8", "--max-model-len",
                                                 "512", "--max-num-batched-tokens", "128"])
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    with open(log, "wb") as f:
        proc = start_server(cmd, f)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 600, str(log))
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def test_sweep_against_the_builtin_model(builtin_server, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    rc = bench_main(["bench", "serve", "--base-url", builtin_server, "--num-prompts", "6",
                     "--random-input-len", "16", "--random-output-len", "8",
                     "--max-concurrency", "1,2", "--save-result", "--result-dir",
                     str(tmp_path), "--result-filename", "sweep.json", "--plot", str(png),
                     "--disable-tqdm", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("Serving Benchmark Result") == 2 and "Mean ITL (ms):" in out
    results = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["max_concurrency"] for r in results] == [1, 2]
    for r in results:
        assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
        assert r["total_output_tokens"] == 6 * 8  # random: ignore_eos, the server's usage
        assert r["total_input_tokens"] == 6 * 16  # 15 random tokens + the BOS, per prompt
        assert r["backend"] == "openai" and r["request_rate"] == "inf"
        assert r["model_id"].endswith("default_model") and r["p99_e2el_ms"] > 0
    assert png.read_bytes()[:8] == PNG


def test_script_chat_sharegpt_against_the_builtin_model(builtin_server, tmp_path, capsys):
    data = write_sharegpt(tmp_path / "sg.json")
    (tmp_path / "r.json").write_text('{"earlier": "run"}\n')
    rc = load_script().main(
        ["--base-url", builtin_server, "--backend", "openai-chat", "--dataset-name",
         "sharegpt", "--dataset-path", str(data), "--num-prompts", "4",
         "--sharegpt-output-len", "4", "--ignore-eos", "--append-result", "--result-filename",
         str(tmp_path / "r.json"), "--disable-tqdm"])
    assert rc == 0, capsys.readouterr()
    earlier, line = (tmp_path / "r.json").read_text().splitlines()  # one JSON value a line
    assert json.loads(earlier) == {"earlier": "run"}
    result = json.loads(line)
    assert (result["completed"], result["total_output_tokens"]) == (4, 16)
    assert result["backend"] == "openai-chat" and result["max_concurrency"] is None
