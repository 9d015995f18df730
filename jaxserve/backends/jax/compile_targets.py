"""Compile-only devices of hardware that is not here: a TPU slice from libtpu's topologies.

`jax.experimental.topologies.get_topology_desc` gives the devices of a real TPU slice
(device_kind, cores, hosts) from libtpu, without a TPU: a Mesh over them and
`jit(...).lower(shapes).compile()` run the real XLA:TPU and Mosaic compilers on this CPU.
The slice of a `jaxserve plan --device` preset is its `topology` (config/accelerators.py).
libtpu comes with `pip install "jax[tpu]"` (and jaxserve's `-e ".[dev]"`); it is found as
the installed `libtpu` package or through TPU_LIBRARY_PATH.
"""

from __future__ import annotations

import os

from jaxserve.config.accelerators import DevicePreset


def target_devices(preset: DevicePreset) -> list:
    """The compile-only devices of a preset's slice, in libtpu's order. ValueError naming
    what is missing: a GPU preset, a TPU preset without a compile-only topology, or no
    libtpu."""
    if preset.device.platform != "tpu":
        raise ValueError(f"{preset.name}: compiling for {preset.device.name} needs a CUDA "
                         "target; `jaxserve compile` compiles for TPU slices (--device "
                         f"{', '.join(tpu_preset_names())}).")
    if not preset.topology:
        raise ValueError(f"{preset.name}: libtpu has no compile-only topology matching this "
                         "slice's devices; compile for another preset of the generation.")
    import jax  # noqa: F401  (first: the topologies module needs the backends registered)
    from jax.experimental import topologies

    # What libtpu reads at start-up on a TPU VM (when unset here: without them it warns
    # that it cannot find them, on a machine that has no TPU to describe); and leave to
    # other processes their own libtpu (it takes a lock for the TPU it would drive, which a
    # compile-only client never opens: concurrent compiles, a server on the same VM).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(preset))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    kwargs = {}
    if preset.num_hosts == 1:
        dims = [int(d) for d in preset.topology.split(":")[1].split("x")]
        kwargs["chips_per_host_bounds"] = (dims + [1, 1])[:3]
    try:
        topology = topologies.get_topology_desc(platform="tpu",
                                                topology_name=preset.topology, **kwargs)
    except RuntimeError as error:
        if "not installed" not in str(error):
            raise
        raise ValueError(f"{preset.name}: compiling for TPUs needs libtpu (pip install "
                         "\"jax[tpu]\", or TPU_LIBRARY_PATH=.../libtpu.so).") from None
    devices = list(topology.devices)
    if len(devices) != preset.num_devices:
        raise ValueError(f"{preset.name}: libtpu's {preset.topology} has {len(devices)} "
                         f"devices, the preset {preset.num_devices}.")
    return devices


def tpu_preset_names() -> list[str]:
    from jaxserve.config.accelerators import PRESETS

    return [p.name for p in PRESETS if p.topology]


def _accelerator_type(preset: DevicePreset) -> str:
    """The TPU_ACCELERATOR_TYPE of a one-host slice ("v5litepod-8", "v6e-8", "v5p-8")."""
    generation, _ = preset.topology.split(":")
    name = {"v5e": "v5litepod"}.get(generation, generation)
    return f"{name}-{preset.name.rsplit('-', 1)[-1]}"
