"""The accelerator table (config/accelerators.py): each device_kind finds its generation,
the numbers agree with JAX's own TPU table, and attention_for chooses by generation: TPU
v2/v3 fall back to the reference attention with one logged reason, v4 and newer get the
TPU kernel with their tiles and VMEM budget, unknown kinds keep the kernel's defaults.
Devices are stand-ins with .platform and .device_kind: no accelerator is needed."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import pytest
from support.abstract_cases import abstract_case

from jaxserve.backends.jax.attend import attention_for
from jaxserve.config.accelerators import (
    ACCELERATORS,
    PRESETS,
    GiB,
    MiB,
    accelerator,
    accelerator_for,
    preset,
)
from jaxserve.kernels_pallas import gpu_ragged_paged_attention, ragged_paged_attention, ref
from jaxserve.kernels_pallas.kernel_layout import TileRule, default_block_sizes

ATTEND_LOG = "jaxserve.backends.jax.attend"


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What attention_for reads of a jax.Device."""

    platform: str
    device_kind: str


# device_kind as JAX reports it -> the table's row (None: unknown, the platform's defaults)
KINDS = [
    ("tpu", "TPU v2", "TPU v2"), ("tpu", "TPU v3", "TPU v3"), ("tpu", "TPU v4", "TPU v4"),
    ("tpu", "TPU v5 lite", "TPU v5e"), ("tpu", "TPU v5e", "TPU v5e"),
    ("tpu", "TPU v5", "TPU v5p"), ("tpu", "TPU v5p", "TPU v5p"),
    ("tpu", "TPU v6 lite", "TPU v6e"), ("tpu", "TPU v6e", "TPU v6e"),
    ("tpu", "TPU7x", "TPU v7x"),
    ("gpu", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB"),
    ("gpu", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB"),
    ("gpu", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB"),
    ("gpu", "NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB"),
    ("gpu", "NVIDIA H100 80GB HBM3", "NVIDIA H100"), ("gpu", "NVIDIA H100 PCIe", "NVIDIA H100"),
    ("gpu", "NVIDIA H100 NVL", "NVIDIA H100 NVL"), ("gpu", "NVIDIA H200", "NVIDIA H200"),
    ("gpu", "NVIDIA B200", "NVIDIA B200"), ("gpu", "NVIDIA L4", "NVIDIA L4"),
    ("rocm", "AMD Instinct MI300X", "AMD MI300X"),
    ("gpu", "NVIDIA L40S", None), ("gpu", "NVIDIA GeForce RTX 4090", None),
    ("tpu", "TPU v9", None), ("cpu", "cpu", None), ("cpu", "TPU v5 lite", None),
]


@pytest.mark.parametrize("platform, kind, name", KINDS)
def test_each_device_kind_finds_its_generation(platform, kind, name):
    row = accelerator_for(platform, kind)
    assert (row.name if row else None) == name


def test_rows_are_per_jax_device():
    # v2/v3 and TPU7x: a device per TensorCore, half the chip; v4 and v5p: megacore
    assert accelerator("TPU v3").hbm_bytes == 16 * GiB  # a 32 GiB chip, 2 devices
    assert accelerator("TPU v4").hbm_bytes == 32 * GiB
    assert accelerator("TPU v5p").hbm_bytes == 95 * GiB
    assert accelerator("TPU v5e").hbm_bytes == 16 * GiB
    assert accelerator("TPU v7x").hbm_bytes == 96 * GiB
    assert all(row.dtype == "bfloat16" for row in ACCELERATORS)
    assert [row.name for row in ACCELERATORS if not row.kernel] == ["TPU v2", "TPU v3"]
    with pytest.raises(ValueError, match="TPU v5e"):
        accelerator("TPU v99")


def test_tpu_rows_agree_with_jax_own_table():
    """Spellings, TensorCores per device, VMEM and bandwidth as JAX's Pallas TPU info has
    them (jax/_src/pallas/mosaic/tpu_info.py); its numbers are per TensorCore."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    for row in (r for r in ACCELERATORS if r.platform == "tpu"):
        versions = {tpu_info.chip_version_from_device_kind(k) for k in row.device_kinds}
        [version] = versions
        assert version is not None, row.name
        cores = version.num_physical_tensor_cores_per_chip // row.devices_per_chip
        assert cores == (2 if version.supports_megacore else 1), row.name
        info = tpu_info.get_tpu_info_for_chip(version, cores)
        assert row.vmem_bytes == info.vmem_capacity_bytes, row.name
        assert row.hbm_bandwidth == pytest.approx(info.mem_bw_bytes_per_second * cores,
                                                  rel=1e-6), row.name
        # JAX counts HBM in decimal bytes of the chip; the table in Google's GiB
        assert row.hbm_bytes == pytest.approx(info.hbm_capacity_bytes * cores, rel=0.08)


def test_tiles_fit_their_vmem_budget():
    for row in (r for r in ACCELERATORS if r.tiles is not None):
        tiles = row.tiles
        assert tiles.vmem_bytes(head_dim=256) <= tiles.vmem_limit_bytes <= row.vmem_bytes
        TileRule(**dataclasses.asdict(tiles))  # the kernel takes the same fields
    assert accelerator("TPU v6e").tiles.keys_per_chunk == 256  # a 256-wide MXU
    assert accelerator("TPU v5e").tiles.keys_per_chunk == 128
    # the tile table applies the keys per chunk: pages of 16 tokens
    assert default_block_sizes(16, 16, 16, keys_per_chunk=256).pages_per_chunk == 16
    assert default_block_sizes(16, 16, 16).pages_per_chunk == 8  # the default: 128 keys


def choose(backend: str, device: FakeDevice, caplog, head_dim: int = 128):
    with caplog.at_level(logging.INFO, logger=ATTEND_LOG):
        return attention_for(backend, device.platform, head_dim, device.device_kind)


@pytest.fixture
def caplog(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("jaxserve"), "propagate", True)  # to caplog
    return caplog


@pytest.mark.parametrize("kind", ["TPU v3", "TPU v2"])
def test_tpu_v2_v3_fall_back_to_the_reference_and_say_why_once(kind, caplog):
    fn = choose("auto", FakeDevice("tpu", kind), caplog)
    assert fn is ref.ragged_paged_attention
    [record] = [r for r in caplog.records if r.name == ATTEND_LOG]
    message = record.getMessage()
    assert message.startswith(f"Attention: {kind}: Mosaic cannot lower")
    assert "using the reference attention" in message


@pytest.mark.parametrize("kind", ["TPU v3", "TPU v2"])
def test_pallas_on_tpu_v2_v3_is_refused_naming_the_generation(kind, caplog):
    with pytest.raises(ValueError, match=f"attention_backend='pallas': {kind} cannot run"):
        choose("pallas", FakeDevice("tpu", kind), caplog)
    # the explicit choices still do what they say
    assert choose("reference", FakeDevice("tpu", kind), caplog) is ref.ragged_paged_attention
    fn = choose("interpret", FakeDevice("tpu", kind), caplog)
    assert fn.func is ragged_paged_attention.ragged_paged_attention
    assert fn.keywords == {"interpret": True}


@pytest.mark.parametrize("kind, keys, vmem", [
    ("TPU v6 lite", 256, 32 * MiB), ("TPU v6e", 256, 32 * MiB), ("TPU7x", 256, 32 * MiB),
    ("TPU v5 lite", 128, 16 * MiB), ("TPU v5", 128, 16 * MiB), ("TPU v4", 128, 16 * MiB)])
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_tpu_v4_and_newer_get_the_kernel_with_their_tiles(backend, kind, keys, vmem, caplog):
    fn = choose(backend, FakeDevice("tpu", kind), caplog)
    assert fn.func is ragged_paged_attention.ragged_paged_attention
    assert fn.keywords == {"interpret": False, "tiling": TileRule(
        keys_per_chunk=keys, min_rows=8, max_tile_rows=256, vmem_limit_bytes=vmem)}
    name = accelerator_for("tpu", kind).name
    assert f"with {name}'s tiles ({keys} keys per chunk" in caplog.text


@pytest.mark.parametrize("device", [FakeDevice("tpu", "TPU v9"), FakeDevice("tpu", "")])
def test_unknown_tpu_kind_keeps_the_kernel_defaults(device, caplog):
    fn = choose("auto", device, caplog)
    assert fn.func is ragged_paged_attention.ragged_paged_attention
    assert fn.keywords == {"interpret": False}  # TileRule() inside the kernel, as before


@pytest.mark.parametrize("kind", ["NVIDIA H100 80GB HBM3", "NVIDIA L4", "NVIDIA GeForce"])
def test_gpus_keep_their_kernel_unchanged(kind, caplog):
    fn = choose("auto", FakeDevice("gpu", kind), caplog)
    assert fn.func is gpu_ragged_paged_attention.ragged_paged_attention
    assert fn.keywords == {"interpret": False}


def kernel_jaxpr(tiling: TileRule | None) -> str:
    """The TPU kernel traced (not run) on a decode bucket of 16-token pages, H = 128."""
    args = abstract_case(64, 64, 8, 1, 128, 16, 512, 32, jnp.bfloat16)
    fn = functools.partial(ragged_paged_attention.ragged_paged_attention, scale=0.125,
                           tiling=tiling)
    return str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("kind", ["TPU v6 lite", "TPU v5 lite"])
def test_the_kernel_receives_the_generation_tiles(kind, caplog):
    """The chosen partial's tiling reaches the pallas_call: its K/V chunk buffers
    [2, C, S, G, H] (G = 1 kv head here) hold keys_per_chunk keys, and Mosaic gets the VMEM
    budget."""
    fn = choose("auto", FakeDevice("tpu", kind), caplog)
    tiles = accelerator_for("tpu", kind).tiles
    text = kernel_jaxpr(fn.keywords["tiling"])
    assert f"[2,{tiles.keys_per_chunk // 16},16,1,128]" in text
    assert f"vmem_limit_bytes={tiles.vmem_limit_bytes}" in text
    default = kernel_jaxpr(None)  # an unknown kind: 128 keys, Mosaic's own VMEM limit
    assert "[2,8,16,1,128]" in default and "vmem_limit_bytes=None" in default


def test_presets_are_built_from_the_table():
    assert {p.name for p in PRESETS} >= {
        "v5e-8", "v5e-16", "v5p-16", "v4-8", "v6e-8", "h100x8", "h200x8", "a100-80gbx8", "l4",
        "colab-v5e-1", "kaggle-v3-8"}
    v5e16 = preset("v5e-16")
    assert (v5e16.num_devices, v5e16.num_hosts, v5e16.memory_bytes) == (16, 4, 16 * GiB)
    assert (preset("v5p-16").num_devices, preset("v5p-16").memory_bytes) == (8, 95 * GiB)
    assert (preset("v4-8").num_devices, preset("V4-8").memory_bytes) == (4, 32 * GiB)
    assert preset("h200x8").memory_bytes == 141 * GiB and preset("l4").num_devices == 1
    assert not preset("kaggle-v3-8").device.kernel
    assert preset("kaggle-v3-8").num_devices == 8
    with pytest.raises(ValueError, match="unknown device 'v5e-3'; known: colab-v5e-1, "):
        preset("v5e-3")
