"""The links between the hosts of a multi-host run (backends/host_link.py, backends/wire.py,
backends/jax/distributed.py's HostLinks): only a host with the operator's key gets a
connection, stray connections (a wrong key, none, garbage, silence) are dropped while the
hosts' own go through, the key never enters the coordinator's store, the listener binds the
address it advertises, and what crosses is plain data: the engine core protocol's real
messages round-trip through the codec (and a remote replica serves over it as the engine
does here), while classes outside the allowlist are refused on both sides."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import socket
import threading
import time

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import SamplingParams
from jaxserve.backends import host_link
from jaxserve.backends.host_link import Link, LinkListener, link_key
from jaxserve.backends.wire import Codec, WireError
from jaxserve.config.engine_config import EngineConfig
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.core.token_constraints import TokenConstraints
from jaxserve.engine.admission import EngineRequest, pooling_sampling_params
from jaxserve.engine.outputs import Logprob
from jaxserve.engine.remote_replica import CORE_CODEC
from jaxserve.engine.sleep_mode import EngineSleepingError, RequestsUnfinishedError
from jaxserve.engine.stats import EngineStats
from jaxserve.models.lora import LoRARequest

KEY = b"k" * 32
OTHER_KEY = b"o" * 32


# ---- the key --------------------------------------------------------------------------------

def test_the_key_comes_from_the_environment_or_a_file(tmp_path):
    assert link_key({host_link.KEY_ENV: " " + "a" * 40 + "\n"}) == b"a" * 40
    secret = tmp_path / "key"
    secret.write_bytes(b"s" * 64 + b"\n")  # (as `kubectl create secret --from-file` keeps it)
    assert link_key({host_link.KEY_FILE_ENV: str(secret)}) == b"s" * 64
    with pytest.raises(ValueError, match="needs a key.*JAXSERVE_HOST_LINK_KEY=KEY.*"
                       "JAXSERVE_HOST_LINK_KEY_FILE=PATH"):
        link_key({})
    with pytest.raises(ValueError, match="is 5 bytes; it must be at least 32"):
        link_key({host_link.KEY_ENV: "short"})
    with pytest.raises(ValueError, match="cannot be read"):
        link_key({host_link.KEY_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="set one"):
        link_key({host_link.KEY_ENV: "a" * 40, host_link.KEY_FILE_ENV: str(secret)})


def test_multi_host_refuses_to_start_without_a_key(monkeypatch):
    """Before jax.distributed is touched: the error says what to set."""
    from jaxserve.backends.jax import distributed

    monkeypatch.delenv(host_link.KEY_ENV, raising=False)
    monkeypatch.delenv(host_link.KEY_FILE_ENV, raising=False)
    joined = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize",
                        lambda *a, **k: joined.append(k))
    with pytest.raises(ValueError, match="JAXSERVE_HOST_LINK_KEY"):
        distributed.initialize("127.0.0.1:1234", 2, 0)
    assert joined == []


def test_the_coordinator_binds_the_address_the_hosts_use(monkeypatch):
    from jaxserve.backends.jax import distributed

    monkeypatch.delenv("JAXSERVE_HOST_IP", raising=False)
    assert distributed.coordinator_bind_address("127.0.0.1:8476") == "127.0.0.1:8476"
    monkeypatch.setenv("JAXSERVE_HOST_IP", "10.1.2.3")
    assert distributed.coordinator_bind_address("leader.hosts:8476") == "10.1.2.3:8476"
    monkeypatch.setenv("JAXSERVE_HOST_IP", "fd00::5")
    assert distributed.coordinator_bind_address("leader.hosts:8476") == "[fd00::5]:8476"


# ---- the listener ---------------------------------------------------------------------------

@pytest.fixture
def listener():
    listener = LinkListener("127.0.0.1", KEY)
    yield listener
    listener.close()


def test_the_listener_binds_the_address_it_advertises(listener):
    sock = listener._socket
    assert sock.getsockname() == listener.address
    assert listener.address[0] == "127.0.0.1" != "0.0.0.0"


def test_stray_connections_are_dropped_and_the_host_still_connects(listener, monkeypatch,
                                                                   caplog):
    """A wrong key, no key (garbage on a raw socket), and a connection that says nothing:
    each is dropped with a warning, none delays or stops the listener, and the host with
    the key gets its connection for its purpose and talks over it."""
    monkeypatch.setattr(host_link, "HANDSHAKE_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="jaxserve.backends.host_link")
    silent = socket.create_connection(listener.address)  # connects and sends nothing
    with pytest.raises((EOFError, OSError)):
        host_link.connect(listener.address, OTHER_KEY, "core:1", timeout=5)
    garbage = socket.create_connection(listener.address)
    garbage.sendall(pickle.dumps(("core:1", "not a handshake")) + b"\0" * 64)
    start = time.monotonic()
    link = Link(host_link.connect(listener.address, KEY, "core:1"), CORE_CODEC)
    served = Link(listener.accept("core:1", timeout=5), CORE_CODEC)
    assert time.monotonic() - start < 1.0  # not behind the silent one
    link.send(("add", ("x", [1, 2])))
    assert served.recv() == ("add", ("x", [1, 2]))
    served.send(("dead", "bye"))
    assert link.recv() == ("dead", "bye")
    # The silent one is dropped once its deadline passes (it reads the challenge, then EOF).
    silent.settimeout(5)
    received = b""
    while chunk := silent.recv(4096):
        received += chunk
    assert received.startswith(b"jaxserve-host-link/")
    deadline = time.monotonic() + 5
    while len(caplog.records) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    reasons = sorted(r.getMessage() for r in caplog.records)
    assert len(reasons) == 3, reasons
    assert sum("does not hold the host-link key" in r for r in reasons) == 2, reasons
    assert any("sent nothing within 1 s" in r for r in reasons), reasons
    # ... and the listener goes on accepting.
    again = host_link.connect(listener.address, KEY, "steps:0")
    assert listener.accept("steps:0", timeout=5)
    for sock in (silent, garbage, again):
        sock.close()
    link.close()
    served.close()


def test_a_host_with_another_key_is_told_so(listener):
    """The listener proves it holds the key too: a host that reached something else, or a
    host of another key, fails instead of talking to it."""
    impostor = socket.create_server(("127.0.0.1", 0))

    def answer():
        peer, _ = impostor.accept()
        peer.sendall(b"jaxserve-host-link/1\n" + b"\0" * 32)
        peer.recv(64)
        peer.sendall(b"\0" * 32)  # not the key's answer
        time.sleep(1)
        peer.close()

    thread = threading.Thread(target=answer)
    thread.start()
    with pytest.raises(host_link.LinkAuthenticationError, match="does not hold the host-link"):
        host_link.connect(impostor.getsockname(), KEY, "core:0", timeout=5)
    thread.join()
    impostor.close()


def test_host_links_publish_addresses_but_never_the_key():
    """Two hosts' HostLinks over one key-value store (a dict here, jax.distributed's in a
    run): each publishes its address, the link goes through, the key is in no entry."""
    from jaxserve.backends.jax.distributed import _STEP_CODEC, HostLinks

    class Store(dict):
        def key_value_set(self, key, value):
            self[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            return self[key]

    store = Store()
    hosts = [HostLinks.open("127.0.0.1", KEY, store, i) for i in range(2)]
    try:
        assert set(store) == {"jaxserve/host/0", "jaxserve/host/1"}
        assert store["jaxserve/host/1"] == "127.0.0.1:%d" % hosts[1].address[1]
        assert not any(KEY.decode() in k or KEY.decode() in v for k, v in store.items())
        sent = hosts[0].connect(1, "steps:0", _STEP_CODEC)
        got = hosts[1].accept("steps:0", _STEP_CODEC)
        message = (16, 2, np.arange(40, dtype=np.int32), None, [(0, np.ones(8, np.float32))],
                   [], None, [(1, LoRARequest("sql", 1, "/adapters/sql"))])
        sent.send(message)
        assert _same(got.recv(), message)
    finally:
        for host in hosts:
            host.close()


# ---- the codec ------------------------------------------------------------------------------

def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and \
            np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _round_trip(message, codec: Codec = CORE_CODEC):
    back = codec.decode(codec.encode(message))
    assert _same(back, message) or back == message, (back, message)
    return back


def _request(**changes) -> EngineRequest:
    structured = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}})
    params = SamplingParams(temperature=0.7, top_p=0.9, n=2, max_tokens=12, seed=3,
                            stop=["\n"], logprobs=2, logit_bias={5: -2.5, 7: 1.0},
                            structured_outputs=structured)
    constraints = TokenConstraints({5: -2.5, 9: -np.inf}, (1, 2, 3), ((4, 5),))
    request = EngineRequest("req-1", "hello", [1, 2, 3], params, priority=1,
                            cache_salt="salt", constraints=constraints, grammar_start=3,
                            lora=LoRARequest("sql", 1, "/adapters/sql",
                                             base_model_name="base"))
    return dataclasses.replace(request, **changes)


def test_engine_core_messages_round_trip(tiny_checkpoints):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 enable_lora=True, max_loras=2, precompile=False)
    ready = _round_trip(("ready", config))
    assert ready[1] == config and hash(ready[1]) == hash(config)
    assert ready[1].scheduler.__dict__.keys() >= {f.name for f in
                                                   dataclasses.fields(config.scheduler)}
    request = _round_trip(("add", _request()))[1]
    assert request == _request() and request.params.structured_outputs.json == {
        "type": "object", "properties": {"a": {"type": "integer"}}}
    pooling = dataclasses.replace(_request(lora=None, constraints=None),
                                  params=pooling_sampling_params(),
                                  pooling=PoolingParams(normalize=True))
    assert _round_trip(("add", pooling))[1] == pooling
    for message in (("abort", "req-1"), ("reset-prefix-cache",), ("close",),
                    ("call", 3, "wake_up", (["weights"],)), ("call", 4, "sleep", (1,)),
                    ("call", 5, "update_weights", ({
                        "model.embed_tokens.weight": np.ones((4, 3), ml_dtypes.bfloat16),
                        "lm_head.weight": np.zeros((4, 3), np.float32)},))):
        _round_trip(message)
    stats = EngineStats(running=2, waiting=1, kv_usage=0.25, spec_accepted_per_pos=(3, 1),
                        replicas=2, replicas_lost=((1, "host 1 is gone"),),
                        lora_running=("sql",))
    from jaxserve.backends.compile_stats import CompileRecords, CompileTimes

    records = CompileRecords(3, 1, {"step": CompileTimes([0, 1, 2], 2, 1.5)})
    entries = [{7: Logprob(-0.1, 1, "a"), 9: Logprob(-2.5, 2, None)}]
    step = ("step", ["r1", "r2"], [5, 6], [
        ("r3", [(0, [4, 5], None, None, -1.25, entries), (1, [], "stop", "\n", None, None)],
         {"scheduled": [1.5, None], "num_cached_tokens": 16,
          "prompt_logprobs": [None, {3: Logprob(-0.5, 1, "b")}]}),
        ("r4", [(0, [], "error", None, None, None)],
         {"error": "structured_outputs: bad", "error_param": "structured_outputs",
          "scheduled": [None], "num_cached_tokens": 0, "prompt_logprobs": None,
          "pooled": np.linspace(0, 1, 8, dtype=np.float32)})],
        (stats, 7, 12, {"schedule": 0.5, "outputs": 0.25}, records))
    _round_trip(step)
    for ok, value in ((True, None), (True, 3), (True, False), (False, ValueError("bad level")),
                      (False, RequestsUnfinishedError("2 unfinished")),
                      (False, EngineSleepingError())):
        back = CORE_CODEC.decode(CORE_CODEC.encode(("reply", 1, ok, value)))
        if isinstance(value, BaseException):
            assert type(back[3]) is type(value) and str(back[3]) == str(value)
        else:
            assert back == ("reply", 1, ok, value)
    failed = CORE_CODEC.decode(CORE_CODEC.encode(("failed", RuntimeError("no devices"))))
    assert type(failed[1]) is RuntimeError and str(failed[1]) == "no devices"


def test_every_class_the_protocol_holds_is_allowlisted():
    """The dataclasses reachable from the protocol's messages through their fields' types: a
    new field of a new config class must join CORE_CODEC's allowlist."""
    import enum
    import typing

    from jaxserve.backends.compile_stats import CompileRecords

    found, todo = set(), [EngineConfig, EngineRequest, EngineStats, CompileRecords, Logprob]
    while todo:
        tp = todo.pop()
        todo.extend(typing.get_args(tp))
        if isinstance(tp, type) and tp not in found and (
                dataclasses.is_dataclass(tp) or issubclass(tp, enum.Enum)):
            found.add(tp)
            if dataclasses.is_dataclass(tp):
                hints = typing.get_type_hints(tp)
                todo.extend(hints[f.name] for f in dataclasses.fields(tp))
    assert found <= set(CORE_CODEC.classes), found - set(CORE_CODEC.classes)


def test_classes_outside_the_allowlist_do_not_cross():
    @dataclasses.dataclass
    class Elsewhere:
        x: int = 0

    with pytest.raises(WireError, match="not in the allowlist"):
        CORE_CODEC.encode(("add", Elsewhere()))
    for value in (object(), print, np.array([object()], dtype=object), OSError("x")):
        with pytest.raises(WireError):
            CORE_CODEC.encode(value)

    def ext(code, payload):
        return msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))

    # A name from the wire is never imported: os.system is no class of the allowlist; an
    # allowlisted class with fields it does not have, or an object dtype, is refused too.
    for data in (ext(4, ["os.system", {"command": "touch /tmp/pwned"}]),
                 ext(6, ["subprocess.Popen", "id"]),
                 ext(5, ["builtins.eval", "1"]),
                 ext(4, ["jaxserve.engine.stats.EngineStats", {"running": 1}]),
                 ext(2, ["object", [1], b"\0" * 8]),
                 ext(99, [1]), b"\xc1", pickle.dumps(("step", 1))[:3]):
        with pytest.raises(WireError):
            CORE_CODEC.decode(data)
    # A pickle is just bytes to the codec: never loaded.
    payload = pickle.dumps(OSError("x"))
    assert CORE_CODEC.decode(CORE_CODEC.encode(payload)) == payload
    with pytest.raises(TypeError):
        Codec([object])


_NAMES = st.sampled_from([f"{c.__module__}.{c.__qualname__}" for c in CORE_CODEC.classes]
                         + ["os.system", "builtins.eval", ""])
_PLAIN = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
                      | st.text(max_size=8)
                      | st.binary(max_size=16),
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


def _extension(code, payload) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))


_MESSAGES = st.one_of(
    st.binary(max_size=64),
    st.builds(_extension, st.integers(0, 12), _PLAIN),
    st.builds(_extension, st.integers(1, 9), st.tuples(_NAMES, _PLAIN).map(list)),
    st.builds(_extension, st.sampled_from([2, 3]),
              st.tuples(st.sampled_from(["float32", "int64", "bfloat16", "object"]),
                        st.lists(st.integers(-2, 4), max_size=3),
                        st.binary(max_size=24)).map(list)))


# The link's message format is an input too: whatever bytes a peer sends, decode returns
# plain data or allowlisted objects, or raises WireError (which breaks the link), nothing
# else.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MESSAGES)
def test_any_bytes_decode_to_data_or_a_wire_error(data):
    try:
        CORE_CODEC.decode(data)
    except WireError:
        pass


def test_a_link_that_gets_a_refused_message_breaks(caplog):
    a, b = multiprocessing.Pipe()
    receiver = Link(a, CORE_CODEC, "from a test")
    b.send_bytes(msgpack.packb(msgpack.ExtType(4, msgpack.packb(["os.system", {}]))))
    with pytest.raises(ConnectionError, match="os.system"):
        receiver.recv()
    b.close()


# ---- a replica over a link ------------------------------------------------------------------

class _BytesOnly:
    """A connection that carries bytes only: nothing can be pickled through it."""

    def __init__(self, connection) -> None:
        self._c = connection
        self.send_bytes, self.recv_bytes = connection.send_bytes, connection.recv_bytes
        self.poll, self.close, self.fileno = connection.poll, connection.close, \
            connection.fileno


def test_a_remote_replica_serves_over_a_link_as_the_engine_does(tiny_checkpoints):
    """serve_core and RemoteReplica (what a lead host and host 0 run) over a bytes-only
    link: the same outputs as the engine in this process, logprobs, stop strings, n > 1 and
    a structured output included."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.engine.remote_replica import RemoteReplica, serve_core

    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    near, far = multiprocessing.Pipe()
    core = threading.Thread(target=serve_core, args=(
        LLMEngine(config), Link(_BytesOnly(far), CORE_CODEC, "test"), 1))
    core.start()
    replica = RemoteReplica(Link(_BytesOnly(near), CORE_CODEC, "test"), "replica 1 (test)")
    local = LLMEngine(config)
    requests = [
        ("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2,
                                           prompt_logprobs=1)),
        ("b", [5, 6, 7], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=10,
                                        stop=["e"])),
        ("c", [8, 9], SamplingParams(temperature=0.0, max_tokens=16,
                                     structured_outputs=StructuredOutputsParams(
                                         choice=["yes", "no"])))]
    try:
        got, want = (_finals(engine, requests) for engine in (replica, local))
        assert got.keys() == want.keys() == {"a", "b", "c"}
        for request_id in want:
            assert [(c.text, list(c.token_ids), c.finish_reason) for c in
                    got[request_id].outputs] == \
                [(c.text, list(c.token_ids), c.finish_reason) for c in
                 want[request_id].outputs]
        assert got["c"].outputs[0].text in ("yes", "no")
        assert got["a"].outputs[0].logprobs[0].keys() == want["a"].outputs[0].logprobs[0].keys()
        assert replica.stats().compilations >= 0 and not replica.is_sleeping()
    finally:
        replica.close()
        core.join(60)
        local.close()
    assert not core.is_alive()


def _finals(engine, requests, timeout: float = 120.0) -> dict:
    for request_id, ids, params in requests:
        engine.add_request(request_id, None, ids, params)
    finals = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the requests did not finish"
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals
