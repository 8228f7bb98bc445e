"""Select's ranking kernels compiled for a GPU offline (no GPU needed): barriers, instructions and
shared memory per kernel, at a decode step's shapes.

    python benchmarks/kernel_sass.py                                  # sm_90 (H100, H200), 128K
    git archive 24d48ea kernels | tar -x -C /tmp/k0
    python benchmarks/kernel_sass.py --kernels /tmp/k0/kernels        # another commit's kernels

The ranking of a row (``_take_top``: a radix select, then each kept entry's place) runs in one
program, a chain of block-wide reductions and scans, each ending in a barrier; at batch 1 the
row's program is the launch's critical path. Triton compiles each kernel for ``--arch`` (the
``triton.compile`` API with a ``GPUTarget``, as a launch would on that GPU) and ``cuobjdump``
(bundled with Triton's NVIDIA backend) lists its SASS: ``BAR.SYNC`` counts the barriers in the
code (static: a barrier in a loop counts once), instructions the SASS lines. A count, not a
time: the timings are ``bench_select.py``'s, on the GPU.

Shapes (Llama-3.1-8B's 8 KV heads, 32 query heads, D 128, 32-token pages): ``_select_ragged``
and ``_topk_ragged`` at a 128K row's decode width (``--context``), the two-level Select's
``_coarse_groups`` and ``_coarse_pages`` (groups of 16 pages, factor 4, the spread launches) at
``--budget`` tokens a head; the pads and warps each launch would take (the wrappers' own
``row_tiles``, ``coarse_candidates``, spread constants).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spin_cluster.bench.args import LLAMA_31_8B_ATTENTION, add_budget_tokens, add_out, save  # noqa: E402

# Pointer arguments by name (the rest are float32); their element types only pick the loads' widths.
_POINTERS = {"want_ptr": "*i64", "count_ptr": "*i64", "out_ptr": "*i64", "ci_ptr": "*i32", "kg_ptr": "*i32",
             "m_ptr": "*i32", "tick_ptr": "*i32", "pages_ptr": "*i32", "n_ptr": "*i32", "bud_ptr": "*i32",
             "q_ptr": "*bf16", "kmin_ptr": "*bf16", "kmax_ptr": "*bf16", "cmin_ptr": "*bf16", "cmax_ptr": "*bf16",
             "dense_ptr": "*u8", "held_ptr": "*u8"}


def kernel_modules(folder: str | None):
    """(_page_select_kernel, _coarse_select_kernel) from ``folder`` (a kernels/ folder, e.g. another
    commit's), loaded as a package of its own so that it does not shadow this checkout's; None:
    this checkout's."""
    if folder is None:
        return (importlib.import_module("spin_cluster.kernels._page_select_kernel"),
                importlib.import_module("spin_cluster.kernels._coarse_select_kernel"))
    pkg = types.ModuleType("kernels_under_test")
    pkg.__path__ = [str(Path(folder).resolve())]
    sys.modules[pkg.__name__] = pkg
    return (importlib.import_module("kernels_under_test._page_select_kernel"),
            importlib.import_module("kernels_under_test._coarse_select_kernel"))


def sass_counts(jit, constexprs: dict, num_warps: int, arch: int) -> dict:
    """Compile ``jit`` for sm_<arch> with these constexprs; its barriers, instructions, shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in jit.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = _POINTERS.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name == "margin" else "i32"
    compiled = triton.compile(ASTSource(jit, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {"barriers": sass.count("BAR.SYNC"), "instructions": len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass)),
            "shared_bytes": compiled.metadata.shared}


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=None, metavar="DIR",
                    help="a kernels/ folder to compile (default: this checkout's), e.g. another commit's")
    ap.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, e.g. 90 (Hopper)")
    ap.add_argument("--context", type=int, default=131072, help="tokens in a row (its decode width)")
    ap.add_argument("--page-size", type=int, default=32)
    add_budget_tokens(ap)
    add_out(ap)
    args = ap.parse_args(argv)

    from bench_select import decode_width

    from spin_cluster.kernels import coarse_select as cs
    from spin_cluster.kernels._triton_support import next_pow2
    from spin_cluster.kernels.page_select import row_tiles

    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 builds the kernels for the interpreter, which compiles nothing: unset it")
    ps_k, cs_k = kernel_modules(args.kernels)
    pages = decode_width(-(-(args.context + 1) // args.page_size))
    p_pad, tail, warps = row_tiles(pages)
    budget_pages = -(-args.budget // args.page_size)
    gp, factor = 16, 4
    c = max(gp, cs.coarse_candidates(budget_pages, pages, gp, factor))
    c_pad, c_tail, _ = row_tiles(c)
    hkv, D = LLAMA_31_8B_ATTENTION["kv_heads"], LLAMA_31_8B_ATTENTION["head_dim"]
    g = LLAMA_31_8B_ATTENTION["heads"] // hkv
    sink, local = 1, 2  # pages, as e2e.py runs Quest
    # the two-level Select's constexprs as coarse_select() derives them
    shape = dict(HKV=hkv, G=g, G_PAD=next_pow2(g), D=D, D_PAD=max(16, next_pow2(D)), GP=gp, HAS_DENSE=False,
                 HAS_HELD=False)
    launches = [
        ("_topk_ragged", ps_k._topk_ragged, dict(P_PAD=next_pow2(pages)), warps),
        ("_select_ragged", ps_k._select_ragged,
         dict(HKV=hkv, P_PAD=p_pad, W_PAD=next_pow2(budget_pages + sink + local), TAIL=tail), warps),
        ("_coarse_groups", cs_k._coarse_groups,
         dict(GT=cs._SPREAD_GROUPS, PG_PAD=max(16, next_pow2(-(-pages // gp))), **shape), cs._SPREAD_WARPS[0]),
        ("_coarse_pages", cs_k._coarse_pages,
         dict(CT=cs._SPREAD_PAGES, TILE=cs._TILE, C_PAD=c_pad, C_TAIL=c_tail, E_PAD=max(16, next_pow2(max(sink, local, 1))), **shape), cs._SPREAD_WARPS[1]),
    ]
    rows = []
    print(f"sm_{args.arch}, {pages} pages a row, {c} candidates; kernels from {args.kernels or 'this checkout'}")
    print(f"{'kernel':<16} {'warps':>5} {'barriers':>8} {'instructions':>12} {'shared B':>9}  constexprs")
    for name, jit, constexprs, num_warps in launches:
        row = {"kernel": name, "num_warps": num_warps, "constexprs": constexprs,
               **sass_counts(jit, constexprs, num_warps, args.arch)}
        rows.append(row)
        shown = {k: v for k, v in constexprs.items() if k.endswith(("PAD", "TAIL")) or k in ("GT", "CT", "TILE")}
        print(f"{name:<16} {num_warps:>5} {row['barriers']:>8} {row['instructions']:>12} {row['shared_bytes']:>9}  {shown}")
    result = {"arch": args.arch, "pages": pages, "candidates": c, "kernels_folder": args.kernels, "launches": rows}
    if args.out:
        save(args, result)
    return rows


if __name__ == "__main__":
    main()
