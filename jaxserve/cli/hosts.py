"""The multi-host flags of `generate` and `serve`, and joining the hosts
(backends/jax/distributed.py): the same command runs on every host; host 0 goes on as the
front end, every other host runs the replicas it has devices of
(engine/remote_replica.run_host) and exits when host 0 closes them. Every host needs the same
host-link key, from the environment (JAXSERVE_HOST_LINK_KEY, or JAXSERVE_HOST_LINK_KEY_FILE
naming a file), not a flag: a command line is visible to every user of the host."""

from __future__ import annotations

import argparse
import logging

from jaxserve.config.backend_capabilities import check_supported


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    """Multi-host flags (backends/jax/distributed.py): the same command runs on every host."""
    parser.add_argument("--coordinator", default=None,
                        help="multi-host: host 0's HOST:PORT, where the hosts meet (every "
                        "host also needs the same key in JAXSERVE_HOST_LINK_KEY or a file "
                        "named by JAXSERVE_HOST_LINK_KEY_FILE)")
    parser.add_argument("--num-hosts", type=int, default=None, help="multi-host: host count")
    parser.add_argument("--host-id", type=int, default=None,
                        help="multi-host: this host's index, 0 serves and schedules")
    parser.add_argument("--multi-host", action="store_true",
                        help="multi-host with the hosts found by JAX itself (a Cloud TPU pod "
                        "slice, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / "
                        "JAX_PROCESS_ID)")


def multi_host(args: argparse.Namespace) -> bool:
    """Whether the multi-host flags are given."""
    return args.multi_host or (args.coordinator, args.num_hosts, args.host_id) != (
        None, None, None)


def join_hosts(args: argparse.Namespace, precompile: bool | str, engine_config) -> None:
    """Multi-host: join the other hosts. Host 0 returns (and goes on as the front end); any
    other host runs the replicas it has devices of until host 0 closes them, and exits the
    process. engine_config: common.py's engine_config (the flags' EngineConfig for a model
    folder). Nothing without the multi-host flags."""
    if not multi_host(args):
        return
    check_supported(args.backend, "multi_host")
    from jaxserve.backends.jax.distributed import initialize, is_leader, leave
    from jaxserve.config.engine_args import EngineArgs
    from jaxserve.engine.remote_replica import run_host

    initialize(args.coordinator, args.num_hosts, args.host_id)
    if is_leader():
        return
    folder = EngineArgs.from_cli(args).model_folder(logging.getLogger("jaxserve"))
    run_host(engine_config(args, folder, precompile))
    leave()
