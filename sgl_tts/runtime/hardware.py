"""Devices for the roofline memory plan: built-in GPU profiles, the GPU-name table that picks one, and a probe of
this host (for CPU runtimes).

`plan_hardware(device, name)` is the one place that decides which profile a plan uses: a configured profile
name; else, on CUDA, the profile of the visible GPU (by `torch.cuda.get_device_name()`); else, on CPU, this
host as probed. A CUDA plan never falls back to host memory.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from policies.cpu_attention import cpu_flags, read_cpuinfo  # the kernels' builder reads the flags too

GIB = 2**30
THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class Hardware:
    """A device for the roofline model: peak FLOP/s, memory bandwidth and size, host-link bandwidth
    (bytes/s, one direction)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: float
    link_bandwidth: float


# Dense FP16/BF16 tensor throughput with FP32 accumulation (NVIDIA Ampere/Ada whitepapers, H200
# datasheet BF16 without sparsity); PCIe 4.0 x16 ≈ 32 GB/s, PCIe 5.0 x16 ≈ 64 GB/s per direction.
HARDWARE: dict[str, Hardware] = {
    "rtx4090": Hardware("rtx4090", 165.2e12, 1008e9, 24 * GIB, 32e9),
    "rtx4070ti": Hardware("rtx4070ti", 80.2e12, 504e9, 12 * GIB, 32e9),
    "rtx3070ti": Hardware("rtx3070ti", 43.5e12, 608e9, 8 * GIB, 32e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9, 64e9),
}
KNOWN_HARDWARE = (*HARDWARE, THIS_MACHINE)

# What torch.cuda.get_device_name() (and nvidia-smi) call each profiled GPU. Exact names only: variants with the
# same number (RTX 4070 Ti SUPER, H200 NVL) have other memory sizes or clocks and need a profile of their own.
DEVICE_NAMES: dict[str, str] = {
    "NVIDIA GeForce RTX 4090": "rtx4090",
    "NVIDIA GeForce RTX 4070 Ti": "rtx4070ti",
    "NVIDIA GeForce RTX 3070 Ti": "rtx3070ti",
    "NVIDIA H200": "h200",
}


def probe_this_machine(seconds: float = 0.5) -> Hardware:
    """Measure this host: FLOP/s from a float32 matmul, bandwidth from a 64 MiB array copy; the host
    link is the memory itself. Takes about `seconds` (well under 2 s)."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    src = np.ones(16 * 2**20, dtype=np.float32)
    dst = np.empty_like(src)
    best_mm, best_copy, deadline = math.inf, math.inf, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ a
        t1 = time.perf_counter()
        np.copyto(dst, src)
        t2 = time.perf_counter()
        best_mm, best_copy = min(best_mm, t1 - t0), min(best_copy, t2 - t1)
    flops = 2 * 512**3 / best_mm
    bandwidth = 2 * src.nbytes / best_copy  # a copy reads and writes every byte
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(THIS_MACHINE, flops, bandwidth, float(mem), bandwidth)


def get_hardware(name: str) -> Hardware:
    """A built-in profile by name, or `this-machine` (probed now)."""
    if name == THIS_MACHINE:
        return probe_this_machine()
    if name not in HARDWARE:
        raise KeyError(f"unknown hardware {name!r}; known: {', '.join(KNOWN_HARDWARE)}")
    return HARDWARE[name]


def profile_for_device(device_name: str) -> Hardware:
    """The profile of a GPU named like `torch.cuda.get_device_name()` says."""
    key = " ".join(device_name.split())
    if key not in DEVICE_NAMES:
        raise KeyError(f"no roofline profile for GPU {device_name!r} (profiled: {', '.join(DEVICE_NAMES)}); "
                       f"set fasttts.hardware to one of {', '.join(HARDWARE)}")
    return HARDWARE[DEVICE_NAMES[key]]


def cuda_device_name() -> str | None:
    """The name of CUDA device 0 as torch reports it, or None when torch sees no CUDA device."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def plan_hardware(device: str, name: str | None, device_name: Callable[[], str | None] | None = None) -> Hardware:
    """The hardware a memory plan for runtimes on `device` ("cpu" or "cuda") uses; `name` is the configured
    profile (None: from the device, named by `device_name()`, default `cuda_device_name`)."""
    if name is not None:
        if device == "cuda" and name == THIS_MACHINE:
            raise ValueError(f"fasttts.hardware {THIS_MACHINE!r} profiles the host (its RAM and cores), not the GPU "
                             f"the cuda runtimes share; leave it unset to use the GPU's profile or name one of "
                             f"{', '.join(HARDWARE)}")
        return get_hardware(name)
    if device == "cpu":
        return probe_this_machine()
    detected = (device_name or cuda_device_name)()
    if detected is None:
        raise ValueError(f"the runtimes run on cuda but this process sees no CUDA device to name the memory "
                         f"plan's hardware; set fasttts.hardware to one of {', '.join(HARDWARE)}")
    return profile_for_device(detected)


# The SIMD extensions that decide which CPU kernels are fast (bf16 and int8 dot products, AMX tiles).
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_summary(cpuinfo: str | None = None) -> str:
    """This host's CPU for a figure's caption: model name, cores, and which of SIMD_FLAGS it has."""
    import platform

    cpuinfo = read_cpuinfo() if cpuinfo is None else cpuinfo
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    flags = cpu_flags(cpuinfo)
    have = [flag for flag in SIMD_FLAGS if flag in flags]
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {' '.join(have) or 'no AVX2'}"
