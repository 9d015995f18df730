"""Multi-host: processes joined by jax.distributed (CPU, gloo collectives, fake devices) run
one model as the mesh lays it over them: one replica split over both hosts (--mesh 1x2,
host 0 sends each step to host 1), or data-parallel replicas each on one host (--mesh 2x4,
4x2: host 0 routes requests, host 1 runs its replicas' engines and sends their tokens back),
or replicas that each span two hosts. The greedy tokens must equal a single process's, and
a host that dies takes only its replicas. The hosts authenticate their links with the key
every host is given (LINK_KEY); stray connections to a host's link listener as the pod
starts (a wrong key, garbage, silence) change nothing (test_host_links.py covers each)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "while True:", "import os\nimport sys\n\nclass Config:",
           "for i in range("]
NEW_TOKENS = 10
ENGINE = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "16"]
LINK_KEY = "test-host-link-key-" + "0" * 32  # (JAXSERVE_HOST_LINK_KEY, the same on every host)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hosts(command: list[str], num_hosts: int, devices_per_host: int,
                log_level: str = "WARNING", log_dir: pathlib.Path | None = None,
                key: str | None = LINK_KEY) -> list[subprocess.Popen]:
    """The same command on num_hosts processes (host 0 last in the list), each with its own
    fake CPU devices and the host-link key; each in a process group of its own. log_dir:
    each host's stderr goes to log_dir / "host{i}.log" (else to a pipe)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_host}")
    env.pop("JAXSERVE_HOST_LINK_KEY_FILE", None)
    if key is None:
        env.pop("JAXSERVE_HOST_LINK_KEY", None)
    else:
        env["JAXSERVE_HOST_LINK_KEY"] = key
    cluster = ["--coordinator", f"127.0.0.1:{free_port()}", "--num-hosts", str(num_hosts)]
    base = [sys.executable, "-m", "jaxserve.cli", "--log-level", log_level]
    return [subprocess.Popen(base + command + cluster + ["--host-id", str(i)], env=env,
                             text=True, stdout=subprocess.PIPE,
                             stderr=open(log_dir / f"host{i}.log", "w") if log_dir else
                             subprocess.PIPE, start_new_session=True)
            for i in reversed(range(num_hosts))]


def finish(hosts: list[subprocess.Popen], timeout: float = 600,
           log_dir: pathlib.Path | None = None) -> list[tuple[str, str]]:
    try:
        results = [host.communicate(timeout=timeout) for host in hosts]
    finally:
        for host in hosts:
            kill(host)
    if log_dir:  # (host 0 last, as start_hosts lists them)
        results = [(out, (log_dir / f"host{len(hosts) - 1 - i}.log").read_text())
                   for i, (out, _) in enumerate(results)]
    for host, (_, err) in zip(hosts, results):
        assert host.returncode == 0, err[-3000:]
    return results


def listener_address(log: pathlib.Path, host: subprocess.Popen) -> tuple[str, int]:
    """Where a host's link listener listens, from its start-up line (log level INFO)."""
    deadline = time.monotonic() + 300
    while not (found := re.search(r"joined; .* listening on ([\d.]+):(\d+)\.",
                                  log.read_text())):
        assert host.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return found[1], int(found[2])


def stray_connections(address: tuple[str, int]) -> list[socket.socket]:
    """A connection with a wrong key, one that sends garbage (a pickle), one that stays
    silent; the last two are returned open."""
    from jaxserve.backends import host_link

    try:
        host_link.connect(address, b"not-the-key-" * 4, "core:1", timeout=30).close()
    except (EOFError, OSError):
        pass
    garbage = socket.create_connection(address)
    garbage.sendall(b"\x80\x04\x95" + b"\0" * 100)
    return [garbage, socket.create_connection(address)]


def kill(host: subprocess.Popen) -> None:
    try:
        os.killpg(host.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def generated(stdout: str) -> list[list[int]]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return [json.loads(line)["outputs"][0]["token_ids"] for line in lines]


def single_process(folder: str, dtype: str = "float32") -> list[list[int]]:
    llm = LLM(folder, dtype=dtype, max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16, precompile=False)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def generate_command(folder: str, mesh: str, dtype: str = "float32") -> list[str]:
    return ["generate", "--model", folder, "--dtype", dtype, *ENGINE, "--mesh", mesh,
            "--max-tokens",
            str(NEW_TOKENS), "--ignore-eos", "--json", *PROMPTS]


def test_replicas_are_laid_host_by_host():
    """Within a host (several per host) or over whole hosts; never part of a host."""
    from types import SimpleNamespace

    from jaxserve.backends.jax.distributed import replica_hosts

    def hosts(count, per_host):
        return [SimpleNamespace(process_index=h, id=h * 100 + i)
                for h in range(count) for i in range(per_host)]

    assert replica_hosts(2, 4, hosts(2, 4)) == [[0], [1]]
    assert replica_hosts(4, 2, hosts(2, 4)) == [[0], [0], [1], [1]]
    assert replica_hosts(2, 2, hosts(4, 1)) == [[0, 1], [2, 3]]
    assert replica_hosts(1, 8, hosts(2, 4)) == [[0, 1]]
    with pytest.raises(ValueError, match="would split a host between replica 0 and another"):
        replica_hosts(2, 3, hosts(3, 2))


# "orbax": the same from a `jaxserve convert` folder, each process restoring only the slices
# of its own device (test_orbax.py covers one process by default).
# Stray connections reach each host's link listener as the pod starts, before host 0
# connects to host 1: each is dropped with a warning, and the pod serves as ever.
@pytest.mark.parametrize("source", ["hf", pytest.param("orbax", marks=pytest.mark.slow)])
def test_two_processes_match_one(source, mesh_checkpoints, tmp_path):
    folder = str(mesh_checkpoints["llama"])
    if source == "orbax":
        from jaxserve.backends.jax.orbax_checkpoint import convert

        folder = str(convert(folder, tmp_path / "orbax"))
    hosts = start_hosts(generate_command(folder, "1x2"), 2, 1, "INFO", tmp_path)
    strays = []
    try:
        for i, host in ((1, hosts[0]), (0, hosts[1])):
            strays += stray_connections(listener_address(tmp_path / f"host{i}.log", host))
        results = finish(hosts, log_dir=tmp_path)
    finally:
        for stray in strays:
            stray.close()
        for host in hosts:
            kill(host)
    assert not generated(results[0][0])  # host 1 prints nothing
    assert generated(results[1][0]) == single_process(folder)
    for _, log in results:  # the wrong key's and the garbage's (silence: after 10 s)
        assert log.count("Host link: dropped a connection") >= 2, log[-3000:]
        assert not re.search(r"^ERROR |Traceback", log, re.M), log[-3000:]


def test_multi_host_refuses_to_start_without_a_key(mesh_checkpoints):
    [host] = start_hosts(generate_command(str(mesh_checkpoints["llama"]), "1x2"), 1, 1,
                         key=None)
    _, err = host.communicate(timeout=120)
    assert host.returncode != 0 and "JAXSERVE_HOST_LINK_KEY" in err, err[-3000:]


# 2x4: one replica per host; 4x2: two per host; 2x2 over four hosts of one device: each
# replica spans two hosts, the second led by host 2 (host 0 routes to it, host 3 follows it);
# 2x1 in bfloat16: one device per replica, so the same computation as one device's.
# (All -m slow: test_a_lost_host... runs data parallelism over two hosts by default.)
@pytest.mark.parametrize("mesh, num_hosts, devices, dtype", [
    pytest.param("2x4", 2, 4, "float32", marks=pytest.mark.slow),
    pytest.param("4x2", 2, 4, "float32", marks=pytest.mark.slow),
    pytest.param("2x2", 4, 1, "float32", marks=pytest.mark.slow),
    pytest.param("2x1", 2, 1, "bfloat16", marks=pytest.mark.slow)])
def test_data_parallel_over_hosts(mesh, num_hosts, devices, dtype, mesh_checkpoints):
    folder = str(mesh_checkpoints["llama"])
    replicas = int(mesh.split("x")[0])
    command = generate_command(folder, mesh, dtype)
    results = finish(start_hosts(command, num_hosts, devices, "INFO"))
    assert generated(results[-1][0]) == single_process(folder, dtype)
    # Every replica led by another host ran steps there (four prompts, least-loaded).
    log = "".join(err for _, err in results[:-1])
    steps = {int(r): int(n) for r, n in re.findall(r"Replica (\d+): stopped after (\d+) steps",
                                                   log)}
    model = int(mesh.split("x")[1])
    led_elsewhere = {r for r in range(replicas) if r * model // devices != 0}  # lead host
    assert set(steps) == led_elsewhere and all(steps.values()), log[-3000:]


def test_a_lost_host_leaves_the_other_replica_serving(mesh_checkpoints):
    """--mesh 2x2 over two hosts of two devices; host 1 (replica 1) is killed while a
    stream runs on each replica: replica 1's request fails, replica 0's finishes, /health
    names the lost replica, and every later request is served by replica 0."""
    folder = str(mesh_checkpoints["llama"])
    port = free_port()
    command = ["serve", "--model", folder, "--dtype", "float32", *ENGINE, "--mesh", "2x2",
               "--port", str(port), "--no-engine-process"]
    hosts = start_hosts(command, 2, 2)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert hosts[1].poll() is None, hosts[1].communicate()[1][-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        body = {"model": folder, "prompt": "def fibonacci(n):", "max_tokens": 100,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        # Two streams at once: one on each replica (least-loaded). Host 1 is killed once
        # each has a few tokens: the one on replica 1 ends in an error, and what it got is
        # the start of replica 0's greedy text (the remote replica's tokens are the same).
        started = [threading.Event(), threading.Event()]
        ends: list = [None, None]
        texts = ["", ""]

        def stream(i: int) -> None:
            reason, chunks = None, 0
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        reason = "error"
                        continue
                    choice = chunk["choices"][0]
                    texts[i] += choice.get("text") or ""
                    chunks += 1
                    if chunks >= 4:
                        started[i].set()
                    reason = choice.get("finish_reason") or reason
            ends[i] = reason

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(120)
        kill(hosts[0])  # host 1
        for thread in threads:
            thread.join(120)
        assert sorted(ends, key=str) == ["error", "length"], ends
        cut, whole = (texts[ends.index("error")], texts[ends.index("length")])
        assert cut and whole.startswith(cut), texts

        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
        report = health.json()
        assert report["status"] == "degraded" and report["replicas_serving"] == 1
        assert [lost["replica"] for lost in report["replicas_lost"]] == [1]
        plain = dict(body, stream=False, max_tokens=12)
        for _ in range(3):
            response = httpx.post(f"{url}/v1/completions", json=plain, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert re.search(r'jaxserve:data_parallel_replicas\{[^}]*state="lost"[^}]*\} 1\.0',
                         metrics), metrics[-2000:]
        hosts[1].send_signal(signal.SIGINT)
        assert hosts[1].wait(120) == 0
    finally:
        for host in hosts:
            kill(host)
