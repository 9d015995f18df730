"""The accelerator table: what the engine needs to know about each generation, by JAX's
`device_kind`, and the rentable shapes `jaxserve plan --device` names.

One row per generation: HBM bytes and bandwidth per JAX device, whether the Pallas kernel
can run there (and why not), the TPU kernel's tile inputs and VMEM budget, and the dtype
its matmul units take (advisory: `plan` warns when the model's differs). `attend.attention_for` reads it to choose the attention (TPU v2/v3
fall back to the reference attention; v4 and newer get the kernel with their tiles), and
`jaxserve plan --device v5e-8` reads the presets built from it. An unknown device_kind has
no row: the platform's defaults apply (the kernel's default tiles, memory from the
device's own statistics or --device-memory). Host-side: no jax import.

Per JAX device, not per chip: TPU v2 and v3 show each of a chip's two TensorCores as a
device with half the chip's HBM; v4 and v5p join theirs (megacore), one device per chip;
v5e and v6e have one TensorCore per chip; TPU7x shows its two TensorCores as two devices.

Sources: JAX 0.10.2's `jax/_src/pallas/mosaic/tpu_info.py` (device_kind
spellings, TensorCores per chip, megacore, VMEM per TensorCore, HBM bandwidth, MXU width)
and `jax/experimental/pallas/ops/tpu/ragged_paged_attention/tuned_block_sizes.py` (JAX's own
ragged paged attention refuses TPU versions below 4); Google Cloud's TPU pages (HBM per
chip in GiB: v2 16, v3 32, v4 32, v5e 16, v5p 95, v6e 32, TPU7x 192); NVIDIA's and AMD's
data sheets (capacity and bandwidth per GPU). NVIDIA and AMD quote HBM in "GB" that the
drivers report as GiB (an A100 80GB shows 81,920 MiB), so those are taken as GiB; a device
reports slightly less than its capacity, which gpu_memory_utilization's margin covers.
"""

from __future__ import annotations

import dataclasses
import re

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """The TPU kernel's tile rule for one generation (kernels_pallas/kernel_layout.TileRule
    takes the same fields; kernel_layout.default_block_sizes applies it per (T, R) bucket).

    keys_per_chunk: L = C * S keys copied and attended per inner step: the scores q . k^T
    are [M, L], so L is the MXU's output width (JAX's tpu_info: 128 columns before v6e, 256
    from v6e). min_rows / max_tile_rows: bounds on a query tile's M = TQ * Gp rows (8: the
    vreg's sublanes). vmem_limit_bytes: the scoped VMEM Mosaic gives the kernel (its
    CompilerParams.vmem_limit_bytes); the largest tile must fit in it (vmem_bytes)."""

    keys_per_chunk: int = 128
    min_rows: int = 8
    max_tile_rows: int = 256
    vmem_limit_bytes: int | None = None  # None: Mosaic's default for the generation

    def vmem_bytes(self, head_dim: int, itemsize: int = 4) -> int:
        """VMEM of the kernel's largest tile (max_tile_rows rows) at head_dim H, queries and
        outputs of itemsize bytes: K and V chunk buffers, double-buffered, [2, L, G, H]
        each, where a page copy's G kv heads (1 of a float32 cache, 2 of bf16, 4 of one
        byte: 32 bits a key) are padded to a full tile of 8 32-bit sublanes, 32 bytes per
        key and lane; the query and output tiles [M, H], double-buffered by the pipeline;
        the m, l and sink rows f32[M, 128]; the accumulator f32[M, H]; and the f32 scores,
        probabilities and mask of one chunk [M, L]."""
        rows, keys = self.max_tile_rows, self.keys_per_chunk
        buffers = 2 * 2 * keys * head_dim * 32
        tiles = 2 * 2 * rows * head_dim * itemsize
        state = 3 * rows * 128 * 4 + rows * head_dim * 4
        scores = 3 * rows * keys * 4
        return buffers + tiles + state + scores


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One generation as JAX shows it. hbm_bytes and hbm_bandwidth are per JAX device."""

    name: str  # "TPU v5e", "NVIDIA H100"
    platform: str  # JAX's platform: "tpu" or "gpu"
    device_kinds: tuple[str, ...]  # JAX's device_kind spellings (exact)
    hbm_bytes: int  # HBM of one JAX device
    hbm_bandwidth: float  # bytes/s of one JAX device
    devices_per_chip: int = 1  # JAX devices per chip (TPU v2/v3 and TPU7x: one per core)
    vmem_bytes: int | None = None  # TPU: VMEM of one TensorCore
    kernel: bool = True  # the platform's Pallas attention kernel runs here
    kernel_note: str = ""  # why it cannot, when it cannot (the log line's reason)
    tiles: KernelTiles | None = None  # TPU: the kernel's tiles; None: its defaults
    # The generation's fast matmul input (MXU / tensor cores); advisory: `plan` warns when
    # the model's dtype differs (the engine's comes from --dtype and the checkpoint).
    dtype: str = "bfloat16"
    pattern: str | None = None  # a regex for device_kind spellings that vary (GPUs)
    # Peak dense bfloat16 matmul FLOP/s of one JAX device (the roofline of `jaxserve
    # compile`; 0: unknown). Sources below the table.
    bf16_flops: float = 0.0

    def __post_init__(self) -> None:
        if self.platform not in ("tpu", "gpu"):
            raise ValueError(f"{self.name}: platform must be 'tpu' or 'gpu', got "
                             f"{self.platform!r}.")
        if self.hbm_bytes <= 0 or self.hbm_bandwidth <= 0:
            raise ValueError(f"{self.name}: HBM bytes and bandwidth must be > 0.")
        if not self.kernel and not self.kernel_note:
            raise ValueError(f"{self.name}: a generation without the kernel needs the reason.")
        if self.tiles is not None and self.tiles.vmem_limit_bytes is not None and (
                self.vmem_bytes is None or self.tiles.vmem_limit_bytes > self.vmem_bytes):
            raise ValueError(f"{self.name}: the kernel's VMEM budget exceeds the VMEM.")


# Why v2 and v3 get the reference attention: JAX's tpu_info lists f32 x f32 as their only
# native matmul, and libtpu's compile-only v2 / v3 targets refuse the kernel in float32 too
# (their DMAs need 1024-byte contiguous rows; a cache page row of 128 f32 is 512 B).
_NO_MOSAIC = ("Mosaic cannot lower the TPU kernel here (no bf16 x bf16 -> f32 dots on "
                   "this generation's MXU, and DMA rows of at least 1024 bytes; JAX's own "
                   "ragged paged attention needs TPU v4 or newer)")
# v4, v5e and v5p (128-column MXU): 128 keys per chunk, as the kernel's default; 16 MiB of
# scoped VMEM, Mosaic's default there and all of v4's VMEM. v6e and TPU7x (256 columns):
# 256 keys, 32 MiB (v6e's default scoped VMEM; half of TPU7x's 64 MiB). The largest tile
# takes about 6 MiB (128 keys) and 11 MiB (256 keys) at head_dim 256, most of it the K/V
# buffers' sublane padding (KernelTiles.vmem_bytes), so neither budget binds: they are
# stated so that a change of tiles is checked against them
# (tests/config/test_accelerators_table.py). Chosen from the hardware, not timed on it.
_TILES_128 = KernelTiles(keys_per_chunk=128, vmem_limit_bytes=16 * MiB)
_TILES_256 = KernelTiles(keys_per_chunk=256, vmem_limit_bytes=32 * MiB)

ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator("TPU v2", "tpu", ("TPU v2",), 8 * GiB, 7.16e11 / 2, devices_per_chip=2,
                vmem_bytes=16 * MiB, kernel=False, kernel_note=_NO_MOSAIC,
                bf16_flops=45e12 / 2),
    Accelerator("TPU v3", "tpu", ("TPU v3",), 16 * GiB, 8.25e11 / 2, devices_per_chip=2,
                vmem_bytes=16 * MiB, kernel=False, kernel_note=_NO_MOSAIC,
                bf16_flops=123e12 / 2),
    Accelerator("TPU v4", "tpu", ("TPU v4",), 32 * GiB, 1.23e12, vmem_bytes=16 * MiB,
                tiles=_TILES_128, bf16_flops=275e12),
    Accelerator("TPU v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 16 * GiB, 8.2e11,
                vmem_bytes=128 * MiB, tiles=_TILES_128, bf16_flops=197e12),
    Accelerator("TPU v5p", "tpu", ("TPU v5", "TPU v5p"), 95 * GiB, 2.46e12,
                vmem_bytes=64 * MiB, tiles=_TILES_128, bf16_flops=459e12),
    Accelerator("TPU v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 32 * GiB, 1.64e12,
                vmem_bytes=128 * MiB, tiles=_TILES_256, bf16_flops=918e12),
    Accelerator("TPU v7x", "tpu", ("TPU7x",), 96 * GiB, 7.4e12 / 2, devices_per_chip=2,
                vmem_bytes=64 * MiB, tiles=_TILES_256, bf16_flops=2307e12 / 2),
    # GPUs: device_kind is the CUDA / ROCm device name ("NVIDIA A100-SXM4-80GB", "NVIDIA
    # H100 80GB HBM3", "AMD Instinct MI300X"); the more specific rows come first.
    Accelerator("NVIDIA A100 80GB", "gpu", (), 80 * GiB, 2.039e12,
                pattern=r"A100.*80\s*GB", bf16_flops=312e12),
    Accelerator("NVIDIA A100 40GB", "gpu", (), 40 * GiB, 1.555e12, pattern=r"A100",
                bf16_flops=312e12),
    Accelerator("NVIDIA H100 NVL", "gpu", (), 94 * GiB, 3.9e12, pattern=r"H100.*NVL",
                bf16_flops=835e12),
    Accelerator("NVIDIA H100", "gpu", (), 80 * GiB, 3.35e12, pattern=r"H100",
                bf16_flops=989e12),
    Accelerator("NVIDIA H200", "gpu", (), 141 * GiB, 4.8e12, pattern=r"H200",
                bf16_flops=989e12),
    Accelerator("NVIDIA B200", "gpu", (), 180 * GiB, 8.0e12, pattern=r"B200",
                bf16_flops=2250e12),
    Accelerator("NVIDIA L4", "gpu", (), 24 * GiB, 3.0e11, pattern=r"\bL4\b",
                bf16_flops=121e12),
    Accelerator("AMD MI300X", "gpu", (), 192 * GiB, 5.3e12, pattern=r"MI300X",
                bf16_flops=1307e12),
)
# bf16_flops: peak dense bf16 matmul FLOP/s per chip, divided among its JAX devices. Google
# Cloud's TPU pages: v2 45, v3 123, v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s per chip;
# TPU7x (Ironwood) 4,614 TFLOP/s of FP8, half that in bf16. NVIDIA's data sheets, dense
# (half the "with sparsity" figure): A100 312, H100 SXM and H200 989, H100 NVL 835, B200
# 2,250, L4 121 TFLOP/s; AMD's MI300X: 1,307 TFLOP/s.

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def accelerator_for(platform: str, device_kind: str | None) -> Accelerator | None:
    """The row of a JAX device (its .platform and .device_kind), or None for an unknown
    kind (the CPU included): the caller keeps the platform's defaults."""
    if not device_kind:
        return None
    family = "tpu" if platform == "tpu" else "gpu" if platform in _GPU_PLATFORMS else None
    for row in ACCELERATORS:
        if row.platform != family:
            continue
        if device_kind in row.device_kinds or (
                row.pattern and re.search(row.pattern, device_kind, re.IGNORECASE)):
            return row
    return None


def accelerator(name: str) -> Accelerator:
    """The row named `name` ("TPU v5e"); ValueError listing the names otherwise."""
    for row in ACCELERATORS:
        if row.name == name:
            return row
    raise ValueError(f"unknown accelerator {name!r}; known: "
                     f"{', '.join(row.name for row in ACCELERATORS)}.")


@dataclasses.dataclass(frozen=True)
class DevicePreset:
    """A shape people rent: num_devices JAX devices of one generation over num_hosts hosts.
    TPU slice names count TensorCores for v2-v5p (a v4-8 is 4 chips, 4 megacore devices;
    a v5p-16 is 8 chips on 2 hosts) and chips for v5e and v6e (a v5e-16 is 16 chips, 4
    hosts of 4)."""

    name: str
    accelerator: str  # an Accelerator's name
    num_devices: int
    num_hosts: int = 1
    note: str = ""
    # TPU: libtpu's name of the slice's topology ("v5e:2x4"), which `jaxserve compile`
    # compiles for without a TPU (jax.experimental.topologies); "" for GPUs.
    topology: str = ""

    @property
    def device(self) -> Accelerator:
        return accelerator(self.accelerator)

    @property
    def memory_bytes(self) -> int:
        """HBM of one device (what --device-memory would say)."""
        return self.device.hbm_bytes

    def describe(self) -> str:
        """'v5e-16: 16 x TPU v5e (16.00 GiB, 820 GB/s each) on 4 hosts'."""
        row = self.device
        hosts = f"{self.num_hosts} hosts" if self.num_hosts > 1 else "one host"
        text = (f"{self.name}: {self.num_devices} x {row.name} ({row.hbm_bytes / GiB:.2f} GiB, "
                f"{row.hbm_bandwidth / 1e9:,.0f} GB/s each) on {hosts}")
        return f"{text}; {self.note}" if self.note else text


PRESETS: tuple[DevicePreset, ...] = (
    DevicePreset("colab-v5e-1", "TPU v5e", 1, note="Colab's TPU v5e runtime",
                 topology="v5e:1x1"),
    DevicePreset("kaggle-v3-8", "TPU v3", 8, note="Kaggle's TPU v3-8 (4 chips, 8 cores)",
                 topology="v3:2x2"),
    DevicePreset("v4-8", "TPU v4", 4),
    DevicePreset("v4-16", "TPU v4", 8, num_hosts=2),
    DevicePreset("v5e-1", "TPU v5e", 1, topology="v5e:1x1"),
    DevicePreset("v5e-4", "TPU v5e", 4, topology="v5e:2x2"),
    DevicePreset("v5e-8", "TPU v5e", 8, topology="v5e:2x4"),
    DevicePreset("v5e-16", "TPU v5e", 16, num_hosts=4, topology="v5e:4x4"),
    DevicePreset("v5p-8", "TPU v5p", 4, topology="v5p:2x2x1"),
    DevicePreset("v5p-16", "TPU v5p", 8, num_hosts=2, topology="v5p:2x2x2"),
    DevicePreset("v5p-64", "TPU v5p", 32, num_hosts=8, topology="v5p:4x4x2"),
    DevicePreset("v6e-1", "TPU v6e", 1, topology="v6e:1x1"),
    DevicePreset("v6e-4", "TPU v6e", 4, topology="v6e:2x2"),
    DevicePreset("v6e-8", "TPU v6e", 8, topology="v6e:2x4"),
    DevicePreset("v6e-16", "TPU v6e", 16, num_hosts=4, topology="v6e:4x4"),
    DevicePreset("l4", "NVIDIA L4", 1),
    DevicePreset("a100-40gbx8", "NVIDIA A100 40GB", 8),
    DevicePreset("a100-80gbx8", "NVIDIA A100 80GB", 8),
    DevicePreset("h100x8", "NVIDIA H100", 8),
    DevicePreset("h200x8", "NVIDIA H200", 8),
    DevicePreset("b200x8", "NVIDIA B200", 8),
    DevicePreset("mi300xx8", "AMD MI300X", 8),
)


def preset(name: str) -> DevicePreset:
    """The preset called `name` (case-insensitive); ValueError listing the known ones."""
    for row in PRESETS:
        if row.name == name.strip().lower():
            return row
    raise ValueError(f"unknown device {name!r}; known: {', '.join(p.name for p in PRESETS)} "
                     "(or give --device-memory SIZE).")
