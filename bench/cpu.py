"""The CPU a benchmark ran on. Every figure names it: the kernels are chosen by its instruction
sets, and one model name ("AMD EPYC" in a VM) covers parts whose vector units differ twofold (a
family 23 model 1 EPYC runs 256-bit AVX2 at half rate), so the family and model numbers go too."""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_FLAGS = ["avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "amx_tile"]


def describe() -> dict:
    """Model name, CPU family and model numbers, cores, the flags that pick kernels, and the
    load average at the start (the machine may be shared)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", "unknown"),
        "family": fields.get("cpu family"),
        "model_number": fields.get("model"),
        "cores": os.cpu_count(),
        "flags": [f for f in KERNEL_FLAGS if f in flags],
        "loadavg_start": os.getloadavg()[0],
    }


def label(cpu: dict | None = None) -> str:
    """One line for the report: 'AMD EPYC (family 23 model 1; avx2; 2 cores)'."""
    cpu = cpu or describe()
    return (f"{cpu['model']} (family {cpu['family']} model {cpu['model_number']}; "
            f"{', '.join(cpu['flags']) or 'no AVX2'}; {cpu['cores']} cores)")
