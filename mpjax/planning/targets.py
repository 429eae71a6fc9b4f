"""The accelerators :func:`mpjax.plan` compiles for without one: GPUs and TPU generations, with
the figures a plan sets its estimates against (memory, bandwidth, peak matmul rates).

A target is named by its chip (``"h100"``, ``"a100"``, ``"h200"``, the Blackwell ``"b200"``,
``"gb200"``, ``"b300"`` and ``"gb300"``; ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, Ironwood's ``"tpu7x"``) for
one chip; for a TPU by a slice topology (``"v5p:2x2x1"``, ``"v5e:2x2"``, ``"tpu7x:2x2x1"``) for the
chips of that slice; for GPUs by hosts
and GPUs per host (``"h100:2x8"``, ``"b200:8"``, ``"gb200:2x4"``). The figures are the vendors'
published dense (not sparse) peaks per chip; XLA's own estimate of a TPU step's time
(``optimal_seconds``) comes from the compiler, not from them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CHIPS", "Chip", "Target", "known_target", "parse_target"]

_T = 1e12
_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """An accelerator chip's published figures.

    Attributes:
      name: the short name (``"v5p"``, ``"h100"``).
      platform: ``"gpu"`` or ``"tpu"``.
      device: what the chip calls itself (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5p"``).
      hbm_bytes: its memory.
      hbm_bandwidth: its memory bandwidth, bytes per second.
      peak_flops: dense matmul FLOP/s by what the matrix units compute: ``"bf16"`` (bfloat16
        and float16 operands), ``"fp8"`` (8-bit floats; absent where the chip has no fp8 matrix
        unit: its fp8 matmuls run at the bf16 rate), ``"fp4"`` (``float4_e2m1fn`` operands, as
        Blackwell's block-scaled GEMMs take them; absent where the chip has none: its fp4
        matmuls run at the fp8 rate, or the bf16 one), ``"tf32"``, ``"f32"`` (float32 without
        tensor cores, on a GPU).
      spec: the GPU's description file in ``gpu_targets/`` (XLA's ``GpuTargetConfigProto``),
        for the CUDA plugin's compile; empty for a TPU.
      interconnect_bandwidth: bytes per second a chip's links to the other chips carry, as
        published (a TPU's inter-chip interconnect); 0 where the system decides it (a GPU's
        NVLink and network).
    """

    name: str
    platform: str
    device: str
    hbm_bytes: int
    hbm_bandwidth: float
    peak_flops: Mapping[str, float]
    spec: str = ""
    interconnect_bandwidth: float = 0.0

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """A GPU's CUDA compute capability, ``(major, minor)``, as its description in
        ``gpu_targets/`` says (``(9, 0)`` for an H100, ``(10, 0)`` for a B200); None for a
        TPU."""
        return _compute_capability(self.spec) if self.spec else None

    @property
    def block_scaled_gemms(self) -> bool:
        """Whether the chip has block-scaled GEMM kernels for MXFP8 and NVFP4 (cuDNN's
        ``__cudnn$blockScaledDot``), as NVIDIA GPUs have from compute capability 10.0
        (Blackwell) on; elsewhere XLA dequantizes a block-scaled matmul into an ordinary one."""
        capability = self.compute_capability
        return capability is not None and capability >= (10, 0)


_CAPABILITY = re.compile(r"cuda_compute_capability\s*\{([^}]*)\}")


@functools.cache
def _compute_capability(spec: str) -> tuple[int, int]:
    """The compute capability the description ``spec`` (a file in ``gpu_targets/``) gives."""
    text = (importlib.resources.files("mpjax.planning") / "gpu_targets" / spec).read_text()
    block = _CAPABILITY.search(text)
    fields = dict(re.findall(r"(major|minor):\s*(\d+)", block[1] if block else ""))
    return int(fields.get("major", 0)), int(fields.get("minor", 0))


CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        Chip(
            "h100",
            "gpu",
            "NVIDIA H100 80GB HBM3",
            84_942_979_072,
            3.35e12,
            {"bf16": 989 * _T, "fp8": 1979 * _T, "tf32": 495 * _T, "f32": 67 * _T},
            "h100_sxm.txtpb",
        ),
        Chip(
            "h200",
            "gpu",
            "NVIDIA H200 141GB HBM3e",
            151_397_597_184,
            4.8e12,
            {"bf16": 989 * _T, "fp8": 1979 * _T, "tf32": 495 * _T, "f32": 67 * _T},
            "h200.txtpb",
        ),
        Chip(
            "a100",
            "gpu",
            "NVIDIA A100-SXM4-80GB",
            85_100_068_864,
            2.04e12,
            {"bf16": 312 * _T, "tf32": 156 * _T, "f32": 19.5 * _T},
            "a100_sxm_80.txtpb",
        ),
        # Blackwell, per GPU: NVIDIA's published figures (the GB200 NVL72 / HGX B200 and HGX
        # B300 specifications, "individual Blackwell GPU") halved where they are given with
        # sparsity (every Tensor Core figure but B300's dense fp4), so dense; float32 without
        # Tensor Cores as published. Memory is the descriptions' device_memory_size (180 GB,
        # 186 GB and 288 GB classes), bandwidth the published 8 TB/s (DGX B200's 64 TB/s over
        # 8 GPUs; the HGX B200 page says 7.7 TB/s, the description 7.67e12).
        Chip(
            "b200",
            "gpu",
            "NVIDIA B200",
            191_514_411_008,
            8e12,
            {
                "bf16": 2250 * _T,
                "fp8": 4500 * _T,
                "fp4": 9000 * _T,
                "tf32": 1100 * _T,
                "f32": 75 * _T,
            },
            "b200.txtpb",
        ),
        Chip(
            "gb200",
            "gpu",
            "NVIDIA GB200",
            197_897_748_480,
            8e12,
            {
                "bf16": 2500 * _T,
                "fp8": 5000 * _T,
                "fp4": 10000 * _T,
                "tf32": 1250 * _T,
                "f32": 80 * _T,
            },
            "gb200.txtpb",
        ),
        # Blackwell Ultra (HGX B300): the bf16, fp8 and tf32 rates of a B200, fp4 dense 13.5 PF
        # (108 PF over 8 GPUs, published dense; GB300's GPUs are rated 15).
        Chip(
            "b300",
            "gpu",
            "NVIDIA B300",
            297_021_865_984,
            8e12,
            {
                "bf16": 2250 * _T,
                "fp8": 4500 * _T,
                "fp4": 13500 * _T,
                "tf32": 1100 * _T,
                "f32": 75 * _T,
            },
            "b300.txtpb",
        ),
        # Blackwell Ultra in a Grace Blackwell superchip (GB300 NVL72): the bf16, fp8 and tf32
        # rates of a GB200, fp4 dense 15 PF (1,080 PF over 72 GPUs, published dense).
        Chip(
            "gb300",
            "gpu",
            "NVIDIA GB300",
            297_021_079_552,
            7.93e12,
            {
                "bf16": 2500 * _T,
                "fp8": 5000 * _T,
                "fp4": 15000 * _T,
                "tf32": 1250 * _T,
                "f32": 80 * _T,
            },
            "gb300.txtpb",
        ),
        # Inter-chip interconnect, per chip: 2,400, 1,600, 4,800 and 3,584 Gbps.
        Chip("v4", "tpu", "TPU v4", 32 * _GIB, 1.2e12, {"bf16": 275 * _T}, "", 300e9),
        Chip("v5e", "tpu", "TPU v5e", 16 * _GIB, 0.819e12, {"bf16": 197 * _T}, "", 200e9),
        Chip("v5p", "tpu", "TPU v5p", 95 * _GIB, 2.765e12, {"bf16": 459 * _T}, "", 600e9),
        Chip("v6e", "tpu", "TPU v6e", 32 * _GIB, 1.64e12, {"bf16": 918 * _T}, "", 448e9),
        # Ironwood: Google's published 4,614 TF fp8 and 192 GiB, 7.37 TB/s and 1.2 TB/s of
        # inter-chip interconnect per chip; bf16 is half the fp8 rate. Two devices per chip.
        Chip(
            "tpu7x",
            "tpu",
            "TPU7x",
            192 * _GIB,
            7.37e12,
            {"bf16": 2307 * _T, "fp8": 4614 * _T},
            "",
            1.2e12,
        ),
    )
}
"""The chips a plan knows, by short name."""

# "v5p:2x2x1", "v5e:2x2": a TPU generation and a slice's chips along each axis.
_TOPOLOGY = re.compile(r"(v\d+[a-z]?|tpu7x):(\d+(?:x\d+){1,2})")
# "h100:2x8", "gb200:8": a GPU and its hosts (one by default) and GPUs per host.
_CLUSTER = re.compile(r"([a-z]+\d+):(?:(\d+)x)?(\d+)")
# The single-chip slice each TPU generation's compiler accepts.
_ONE_CHIP = {"v4": "1x1x1", "v5p": "1x1x1", "v5e": "1x1", "v6e": "1x1", "tpu7x": "1x1x1"}
# TPU passes of bf16 per float32 matmul at each precision: one pass at DEFAULT, three at HIGH
# (bf16_3x), six at HIGHEST (bf16_6x). On a GPU, HIGH and DEFAULT are TF32, HIGHEST is float32.
_TPU_F32_PASSES = {"default": 1, "high": 3, "highest": 6}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a plan compiles for: a chip, and for a TPU the slice's topology.

    Attributes:
      name: the name given (lowercase): ``"h100"``, ``"v5p"``, ``"v5p:2x2x1"``, ``"h100:2x8"``.
      chip: the :class:`Chip`.
      topology: the topology the compiler is asked for (``"v5p:1x1x1"`` for ``"v5p"``); for
        GPUs, JAX's CUDA plugin's ``slices x hosts x GPUs per host`` (``"1x1x1"`` for one,
        ``"1x2x8"`` for ``"h100:2x8"``).
    """

    name: str
    chip: Chip
    topology: str

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def chips(self) -> int:
        """How many chips the target has."""
        counts = self.topology.split(":")[-1].split("x")
        total = 1
        for count in counts:
            total *= int(count)
        return total

    def peak_flops(self, lhs: str, rhs: str, precision: str = "default") -> float:
        """The chip's peak FLOP/s for a matmul on ``lhs`` x ``rhs`` operands (dtype names) at
        ``precision`` (``"default"``, ``"high"``, ``"highest"``: how float32 operands are
        multiplied; other operands ignore it).

        Two 4-bit float operands (``float4_e2m1fn``) run at the ``"fp4"`` peak, falling back to
        the ``"fp8"`` one and then the bf16 one where the chip lacks it; 8-bit floats at the
        ``"fp8"`` peak (or the bf16 one); an fp8 operand with an fp4 one at the slower of the
        two; any other pair of 16-bit or narrower floats at the bf16 peak."""
        peaks = self.chip.peak_flops
        fp8 = peaks.get("fp8", peaks["bf16"])
        rates = {"fp4": peaks.get("fp4", fp8), "fp8": fp8}
        kinds = [kind for kind in (_narrow_kind(d) for d in (lhs, rhs)) if kind is not None]
        if len(kinds) == 2:
            return min(rates.get(kind, peaks["bf16"]) for kind in kinds)
        if self.platform == "tpu":
            return peaks["bf16"] / _TPU_F32_PASSES.get(precision, 1)
        return peaks["f32"] if precision == "highest" else peaks.get("tf32", peaks["f32"])


def _narrow_kind(dtype: str) -> str | None:
    """Which peak a matmul operand of ``dtype`` (a name) runs at: ``"fp4"``, ``"fp8"``,
    ``"bf16"`` (bfloat16, float16), or None for a wider one."""
    if dtype.startswith("float4"):
        return "fp4"
    if dtype.startswith("float8"):
        return "fp8"
    return "bf16" if dtype in ("bfloat16", "float16") else None


def parse_target(target: Any, *, caller: str = "plan") -> Target:
    """The :class:`Target` named by ``target``.

    Raises:
      ValueError: naming the valid chips and the topology form, if ``target`` is not one.
    """
    name = target.lower() if isinstance(target, str) else None
    if name in CHIPS:
        chip = CHIPS[name]
        topology = f"{name}:{_ONE_CHIP[name]}" if chip.platform == "tpu" else "1x1x1"
        return Target(name, chip, topology)
    match = _TOPOLOGY.fullmatch(name or "")
    if match and match[1] in CHIPS and CHIPS[match[1]].platform == "tpu":
        axes = match[2].count("x") + 1
        if axes == len(_ONE_CHIP[match[1]].split("x")):
            return Target(name or "", CHIPS[match[1]], name or "")
    cluster = _CLUSTER.fullmatch(name or "")
    if cluster and cluster[1] in CHIPS and CHIPS[cluster[1]].platform == "gpu":
        hosts, per_host = int(cluster[2] or 1), int(cluster[3])
        if hosts >= 1 and per_host >= 1:
            return Target(name or "", CHIPS[cluster[1]], f"1x{hosts}x{per_host}")
    gpus = sorted(c for c in CHIPS if CHIPS[c].platform == "gpu")
    tpus = sorted(c for c in CHIPS if CHIPS[c].platform == "tpu")
    raise ValueError(
        f"{caller}: unknown target {target!r}; valid targets: GPUs {gpus}, TPUs {tpus} (one "
        "chip), a TPU slice as 'generation:topology' with the generation's axes, such as "
        "'v5p:2x2x1', 'v4:2x2x2', 'v5e:2x2', 'v6e:4x4', or GPUs on hosts as "
        "'gpu:HOSTSxGPUS' ('h100:2x8': 2 hosts of 8; 'gb200:2x4') or 'gpu:GPUS' ('h100:8', "
        "'b200:8': one host)."
    )


def known_target(name: str) -> Target | None:
    """The target ``name`` names, or None for a name a plan read from HLO text was given."""
    try:
        return parse_target(name)
    except ValueError:
        return None
