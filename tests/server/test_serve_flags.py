"""The `vllm serve` flags of the issue at work in a running server: HTTPS (--ssl-keyfile,
--ssl-certfile), --root-path, --config FILE.yaml with k sizes, --log-format json for every
line (jaxserve's, uvicorn's access lines, progress as log lines instead of bars),
--enable-log-requests / --enable-log-outputs, --enable-request-id-headers and
--disable-access-log-for-endpoints; and the shared text format in-process."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import ssl
import subprocess
import time

import httpx
import pytest
from support.server_helpers import JAXSERVE, free_port
from support.tls import certificate

from jaxserve.config import logs


def test_https_root_path_json_logs_and_request_lines(tiny_checkpoints, tmp_path):
    cert, key, _ = certificate(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text("served-model-name: [tiny]\nmax-model-len: 0.5k\nmax-num-seqs: 8\n"
                      "max-num-batched-tokens: 128\nenable-log-requests: true\n")
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [str(JAXSERVE), "serve", str(tiny_checkpoints["llama"]), "--port", str(port),
           "--config", str(config), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
           "--root-path", "/llm", "--log-format", "json", "--enable-request-id-headers",
           "--enable-log-outputs", "--disable-access-log-for-endpoints", "/health"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)),
                          timeout=60) as client:
            deadline = time.monotonic() + 240
            while True:
                assert process.poll() is None, log_path.read_text()[-3000:]
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.25)
            models = client.get(f"{url}/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            assert models["data"][0]["max_model_len"] == 500  # 0.5k from the YAML file
            assert client.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/llm"}]
            body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
            mine = client.post(f"{url}/v1/completions", json=body,
                               headers={"X-Request-Id": "my-id-1"})
            assert mine.status_code == 200 and mine.headers["x-request-id"] == "my-id-1"
            assert mine.json()["id"] == "cmpl-my-id-1"
            theirs = client.post(f"{url}/v1/completions", json=body)
            assert len(theirs.headers["x-request-id"]) >= 16
            text = mine.json()["choices"][0]["text"]
        with pytest.raises(httpx.HTTPError):  # HTTPS only
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    records = []
    for line in lines:  # every line one JSON record: no progress bars, no second format
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"a server log line that is not JSON: {line[:200]!r}")
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    messages = [(r["logger"], r["message"]) for r in records]
    access = [m for name, m in messages if name == "uvicorn.access"]
    assert any("/v1/models" in m for m in access) and not any("/health" in m for m in access)
    assert any(name == "jaxserve.config.progress" and m.startswith("Loading weights")
               for name, m in messages)
    assert any(f"on https://127.0.0.1:{port}/llm" in m for _, m in messages)
    received = [m for _, m in messages if m.startswith("Received request cmpl-my-id-1")]
    assert received and "'def f(x):'" in received[0]
    assert any(m.startswith("request cmpl-my-id-1") and "finish length" in m
               for _, m in messages)
    assert any(m == f"request cmpl-my-id-1-0: output 0: {text!r}" for _, m in messages)


@pytest.fixture
def root_logging(monkeypatch):
    """Restores the root logger and the inherited log settings after a test."""
    root, ours = logging.getLogger(), logging.getLogger("jaxserve")
    saved = (list(root.handlers), root.level, list(ours.handlers), ours.propagate, ours.level)
    for name in ("JAXSERVE_LOG_FORMAT", "JAXSERVE_LOG_CONFIG_FILE"):
        # set first, so that the undo removes what logs.configure sets (a later test's
        # servers inherit this process's environment)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.handlers[:], ours.propagate = saved[2], saved[3]
    ours.setLevel(saved[4])
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.filters.clear()
        logger.disabled = False


def _written() -> io.StringIO:
    """The root handler's output, from now on."""
    out = io.StringIO()
    logging.getLogger().handlers[0].setStream(out)
    return out


def test_jaxserve_and_uvicorn_lines_share_one_text_format(root_logging):
    logs.configure("INFO", "text")
    logs.configure_uvicorn("info", access_log=True, quiet_paths=("/health",))
    out = _written()
    logging.getLogger("jaxserve.test").info("hello")
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    access = logging.getLogger("uvicorn.access")
    for path in ("/health", "/v1/models?x=1"):
        access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", path, "1.1", 200)
    lines = out.getvalue().splitlines()
    shape = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d (\S+): (.*)$")
    parsed = [shape.match(line) for line in lines]
    assert all(parsed), lines
    assert [(m[1], m[2][:20]) for m in parsed] == [
        ("jaxserve.test", "hello"), ("uvicorn.error", "Application startup "),
        ("uvicorn.access", '127.0.0.1:5 - "GET /')]
    assert "/v1/models" in parsed[2][2]


def test_a_log_config_file_replaces_the_format(root_logging, tmp_path):
    conf = tmp_path / "logging.json"
    conf.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "CUSTOM|%(name)s|%(message)s"}},
        "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "plain"}},
        "root": {"level": "INFO", "handlers": ["err"]}}))
    logs.configure("INFO", config_file=str(conf))
    out = _written()
    logging.getLogger("jaxserve.test").info("through the file")
    assert out.getvalue() == "CUSTOM|jaxserve.test|through the file\n"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ValueError, match="dictConfig"):
        logs.configure("INFO", config_file=str(bad))
    with pytest.raises(ValueError, match="log format"):
        logs.configure("INFO", "xml")
