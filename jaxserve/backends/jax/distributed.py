"""Multi-host serving: the hosts joined by jax.distributed, the replicas laid over them, and
the connections between them.

`jaxserve serve --coordinator HOST:PORT --num-hosts N --host-id I` (or `--multi-host`: JAX's
own environment, e.g. a Cloud TPU pod slice, where jax.distributed finds everything itself)
joins the N processes. `--mesh DxM` then lays D replicas of M devices over every host's
devices, host by host (replica_hosts): a replica lies within one host (M divides a host's
device count; a host may hold several) or spans whole hosts (a host's count divides M).

Host 0 runs the front end (HTTP/gRPC, admission, DataParallelEngine's least-loaded routing).
A replica is run by its lead host, the first of its hosts: host 0's own replicas are engines
in host 0's process; every other lead host runs its replicas' engines (scheduler and runner)
and serves each to host 0 as an engine core over a connection (engine/remote_replica.py, the
engine core process's protocol), so each replica's host work runs on its own host. A host
of a replica that spans hosts but does not lead it follows its lead host's steps
(ModelRunner.follow): it receives each step the lead host is about to run (its (T, R)
bucket, the packed int32 inputs, the prompt-scoring targets, the pooling inputs) through a
StepChannel and runs the same compiled functions on them, so the collectives inside the step
line up.

The hosts meet at the coordinator (jax.distributed), which host 0 binds on the address the
other hosts reach it at (the coordinator's host, as this host's interface to it, or
JAXSERVE_HOST_IP), not on every interface. Each host publishes in the coordinator's
key-value store the address its host links listen on (HostLinks, the same address, bound
alone); the links (backends/host_link.py) are authenticated with the operator's key
(JAXSERVE_HOST_LINK_KEY or JAXSERVE_HOST_LINK_KEY_FILE), which never goes through the store,
and carry plain data (backends/wire.py), never pickles. jax.distributed runs with
recoverability on: a lead host that dies takes its replicas (host 0 stops routing to them),
not the job. A host that only follows a replica is not watched: when it dies, its
replica's steps fail or wait.
"""

from __future__ import annotations

import logging
import os
import socket

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.backends import host_link
from jaxserve.backends.host_link import Link
from jaxserve.backends.wire import Codec
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.mesh import AXES, ModelDims, check_devices
from jaxserve.models.lora import LoRARequest

logger = logging.getLogger(__name__)

_KEY = "jaxserve/"  # jax.distributed key-value store entries
_LOOKUP_TIMEOUT_MS = 15 * 60 * 1000  # how long a host waits for another's address
_STOP = None  # StepChannel's message to stop following
_STEP_CODEC = Codec([LoRARequest])  # what a StepChannel carries beside arrays and numbers

_links: HostLinks | None = None


def replica_mesh(config: EngineConfig, rank: int = 0) -> Mesh:
    """The (1, model) mesh of data-parallel replica `rank`: the rank-th run of `model`
    devices (host by host on several hosts). Checks first that the configured mesh fits the
    devices there are."""
    parallel = config.parallel
    devices = jax.devices()
    check_devices(parallel.mesh, len(devices), ModelDims.from_hf(config.model.hf_config),
                  parallel.expert_parallel)
    model = parallel.mesh.model
    if jax.process_count() > 1:
        replica_hosts(parallel.mesh.data, model)  # (checks the layout)
        devices = ordered_devices()
    mine = devices[rank * model:(rank + 1) * model]
    return Mesh(np.array(mine).reshape(1, model), AXES)


def initialize(coordinator: str | None, num_hosts: int | None, host_id: int | None) -> None:
    """Join the hosts (before anything touches a JAX backend) and open this host's listening
    socket. With no arguments, JAX reads its environment (JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a TPU pod's metadata). ValueError first when the
    host-link key is not set (host_link.link_key)."""
    global _links
    given = [coordinator is not None, num_hosts is not None, host_id is not None]
    if any(given) and not all(given):
        raise ValueError("multi-host needs all of --coordinator HOST:PORT, --num-hosts N and "
                         "--host-id I (or none of them, to let JAX read its environment).")
    if num_hosts is not None and not 0 <= host_id < num_hosts:
        raise ValueError(f"--host-id must be in [0, {num_hosts}), got {host_id}.")
    key = host_link.link_key()
    # CPU hosts need gloo for cross-process collectives; accelerators ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A host that dies takes its replicas with it, not the job (host 0 keeps serving).
    jax.config.update("jax_enable_recoverability", True)
    # Host 0's coordinator on the address the others use (the operator's
    # JAX_COORDINATOR_BIND_ADDRESS first, which jax.distributed reads itself).
    known = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    chosen = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    bind = coordinator_bind_address(known) if known and not chosen else None
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_hosts,
                               process_id=host_id, coordinator_bind_address=bind)
    if jax.process_index() == 0 and bind is None and not chosen:
        logger.warning("The coordinator (found by JAX) listens on every interface: give "
                       "--coordinator HOST:PORT, or set JAX_COORDINATOR_BIND_ADDRESS=IP:PORT, "
                       "and firewall its port (docs/deployment.md, \"Security\").")
    from jax._src.distributed import global_state

    _links = HostLinks.open(_reachable_ip(coordinator or global_state.coordinator_address),
                            key, global_state.client, jax.process_index())
    logger.info("Host %d of %d joined; %d devices in all, %d here; listening on %s:%d.",
                jax.process_index(), jax.process_count(), jax.device_count(),
                jax.local_device_count(), *_links.address)


def coordinator_bind_address(coordinator: str) -> str:
    """Where host 0's coordinator listens: the coordinator's port on this host's address
    that the others reach (_reachable_ip), not every interface (jax.distributed's default)."""
    port = coordinator.rsplit(":", 1)[1]
    ip = _reachable_ip(coordinator)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def leave() -> None:
    """End a host other than 0 once its replicas are done: exit the process at once. With
    recoverability on, host 0 does not wait for the others when it stops, so a host that
    disconnected from the coordination service in the usual way (JAX's exit handler) could
    find it gone, which aborts the process."""
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def is_leader() -> bool:
    """Whether this process is host 0 (the front end), or the only one."""
    return jax.process_index() == 0


def links() -> HostLinks:
    if _links is None:
        raise RuntimeError("the hosts are not joined (distributed.initialize)")
    return _links


def ordered_devices() -> list:
    """Every device, host by host (replicas are laid over them in this order)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def replica_hosts(num_replicas: int, model: int, devices=None) -> list[list[int]]:
    """Per replica (of `model` devices each, laid over ordered_devices(), or `devices`), its
    hosts' process indices, its lead host first. ValueError when a replica would share a
    host with another replica while spanning hosts."""
    devices = ordered_devices() if devices is None else devices
    per_host = {}
    for d in devices:
        per_host[d.process_index] = per_host.get(d.process_index, 0) + 1
    layout = []
    for rank in range(num_replicas):
        hosts = sorted({d.process_index for d in devices[rank * model:(rank + 1) * model]})
        if len(hosts) > 1 and sum(per_host[h] for h in hosts) != model:
            counts = sorted(set(per_host.values()))
            raise ValueError(
                f"--mesh {num_replicas}x{model} over hosts of {counts} devices would split a "
                f"host between replica {rank} and another: a replica must lie within one host "
                "(its device count divides a host's) or span whole hosts (a host's count "
                "divides it).")
        layout.append(hosts)
    return layout


def step_channel(mesh) -> StepChannel | None:
    """The StepChannel of a replica's mesh that spans hosts (None within one host)."""
    hosts = sorted({d.process_index for d in mesh.devices.flat})
    if len(hosts) == 1:
        return None
    return StepChannel(links(), f"steps:{min(d.id for d in mesh.devices.flat)}", hosts)


class HostLinks:
    """This host's listening socket and the way to every other host's: host 0 connects to a
    lead host for each replica it serves, a lead host to the other hosts of its replica. A
    connection's purpose is named in its handshake; accept() returns the one asked for and
    keeps others that came first (backends/host_link.py)."""

    def __init__(self, listener: host_link.LinkListener, key: bytes, store) -> None:
        self._listener, self._key, self._store = listener, key, store
        self.address = listener.address

    @classmethod
    def open(cls, ip: str, key: bytes, store, index: int) -> HostLinks:
        """Listen on `ip` (the address the other hosts reach this one at) and publish it in
        `store` (jax.distributed's key-value store) as host `index`'s. The key stays here."""
        listener = host_link.LinkListener(ip, key)
        store.key_value_set(f"{_KEY}host/{index}", f"{ip}:{listener.address[1]}")
        return cls(listener, key, store)

    def connect(self, host: int, purpose: str, codec: Codec) -> Link:
        where = self._store.blocking_key_value_get(f"{_KEY}host/{host}", _LOOKUP_TIMEOUT_MS)
        ip, port = where.rsplit(":", 1)
        connection = host_link.connect((ip, int(port)), self._key, purpose)
        return Link(connection, codec, f"to host {host} ({purpose})")

    def accept(self, purpose: str, codec: Codec) -> Link:
        return Link(self._listener.accept(purpose), codec, f"from a host ({purpose})")

    def close(self) -> None:
        self._listener.close()


def _reachable_ip(coordinator: str | None) -> str:
    """The address other hosts reach this one at: JAXSERVE_HOST_IP if set, else that of the
    interface that routes to the coordinator HOST:PORT (or this host name's)."""
    if os.environ.get("JAXSERVE_HOST_IP"):
        return os.environ["JAXSERVE_HOST_IP"]
    if coordinator:
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # (a datagram socket sends nothing on connect)
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class StepChannel:
    """A replica's lead host -> its other hosts: each step's bucket and inputs, or the order
    to stop (one message of plain data per step, encoded once and sent to each host)."""

    def __init__(self, host_links: HostLinks, purpose: str, hosts: list[int]) -> None:
        """hosts: the replica's process indices, the lead host first."""
        self.leads = jax.process_index() == hosts[0]
        if self.leads:
            self._peers = [host_links.connect(h, purpose, _STEP_CODEC) for h in hosts[1:]]
        else:
            self._source = host_links.accept(purpose, _STEP_CODEC)

    def send(self, num_tokens: int, num_rows: int, packed: np.ndarray,
             targets: np.ndarray | None, bias_rows: list[tuple[int, np.ndarray]],
             grammar_rows: list[tuple[int, np.ndarray]],
             pool: np.ndarray | None = None, loads: list = ()) -> None:
        """bias_rows: [(sampler row, f32[V])]; grammar_rows: [(sampler row, i32[W])]: the
        sampler-state rows to write before the step; pool: its pooling inputs i32[T + R];
        loads: the LoRA adapters to write into their slots first [(slot, LoRARequest)]
        (each host reads the adapter's folder itself)."""
        self._send((num_tokens, num_rows, packed, targets, bias_rows, grammar_rows, pool,
                    list(loads)))

    def send_stop(self) -> None:
        self._send(_STOP)

    def receive(self):
        """(num_tokens, num_rows, packed i32[X], targets i32[T] or None, bias rows, grammar
        rows, pooling inputs or None, LoRA loads), or None: stop (also when the lead host is gone)."""
        try:
            return self._source.recv()
        except (EOFError, OSError):
            logger.error("Host %d: the lead host of its replica is gone.", jax.process_index())
            return None

    def share(self, value: int) -> int:
        """The lead host's value of an integer, on every host (e.g. the KV block count)."""
        if self.leads:
            self._send(int(value))
            return int(value)
        return int(self._source.recv())

    def _send(self, message) -> None:
        data = _STEP_CODEC.encode(message)
        for peer in self._peers:
            peer.send_encoded(data)
