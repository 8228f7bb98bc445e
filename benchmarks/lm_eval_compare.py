"""lm-evaluation-harness through a running server against lm-eval's own HuggingFace backend, on
the same model and tasks (the YAMLs of benchmarks/lm_eval_tasks/, over JSON in the repo):

    hf                      lm-eval's transformers backend, in this process
    local-completions       the server's /v1/completions: loglikelihood (echo + logprobs) and
                            generate-until, prompts sent as token ids
    local-chat-completions  the server's /v1/chat/completions: generate-until through the chat
                            template (and the HF backend with the same template beside it)

Per task it reports the metric of each, and per loglikelihood request the largest difference
between the server's and HF's sum of logprobs. lm-eval's Python entry point
(``simple_evaluate``) is the one its CLI calls; docs/serving.md has the CLI command.

    .venv/bin/spin-cluster serve --port 8011 &
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python benchmarks/lm_eval_compare.py \\
        --url http://127.0.0.1:8011 --out benchmarks/results/accuracy/DATE-cpu-lm-eval-COMMIT.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from spin_cluster.model_store import default_model_path
from spin_cluster.provenance import provenance, write_json

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
METRICS = {"spin_mc": "acc,none", "spin_ruler": "string_match_all,none"}


def evaluate(model: str, model_args: str, tasks: list[str], chat: bool) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.monotonic()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1,
                                  task_manager=TaskManager(include_path=str(TASKS)), apply_chat_template=chat,
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return {"seconds": round(time.monotonic() - t0, 1),
            "metrics": {t: out["results"][t][METRICS[t]] for t in tasks},
            "samples": {t: [_responses(s) for s in out["samples"][t]] for t in tasks}}


def _responses(sample: dict) -> list:
    """A doc's answers: (loglikelihood, is_greedy) per choice, or the generated text."""
    return [r[0] if isinstance(r[0], str) else [float(r[0][0]), bool(r[0][1])] for r in sample["resps"]]


def compare(server: dict, hf: dict) -> dict:
    """Per task: docs, docs whose answers differ (generated text, or the argmax choice), and the
    largest loglikelihood difference."""
    out = {}
    for task, docs in server["samples"].items():
        ref = hf["samples"][task]
        diffs = [abs(a[0] - b[0]) for d, r in zip(docs, ref) for a, b in zip(d, r) if isinstance(a, list)]
        differ = sum(_answer(d) != _answer(r) for d, r in zip(docs, ref))
        out[task] = {"docs": len(docs), "docs_answered_differently": differ,
                     "max_abs_loglikelihood_diff": max(diffs) if diffs else None}
    return out


def _answer(responses: list):
    if isinstance(responses[0], str):
        return responses[0]
    lls = [r[0] for r in responses]
    return lls.index(max(lls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8011")
    ap.add_argument("--model", default=None, help="the served model name (default: the folder's name)")
    ap.add_argument("--model-path", default=str(default_model_path()))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = args.model or Path(args.model_path).name
    tok = f"tokenizer_backend=huggingface,tokenizer={args.model_path}"
    runs = {
        "hf": evaluate("hf", f"pretrained={args.model_path},dtype=float32,device=cpu", ["spin_mc", "spin_ruler"], False),
        "local-completions": evaluate(
            "local-completions", f"model={name},base_url={args.url}/v1/completions,{tok},max_retries=1",
            ["spin_mc", "spin_ruler"], False),
        "hf-chat": evaluate("hf", f"pretrained={args.model_path},dtype=float32,device=cpu", ["spin_ruler"], True),
        "local-chat-completions": evaluate(
            "local-chat-completions", f"model={name},base_url={args.url}/v1/chat/completions,{tok},max_retries=1",
            ["spin_ruler"], True),
    }
    result = {"provenance": provenance(), "url": args.url, "model_path": args.model_path,
              "runs": {k: {"seconds": v["seconds"], "metrics": v["metrics"]} for k, v in runs.items()},
              "completions_vs_hf": compare(runs["local-completions"], runs["hf"]),
              "chat_vs_hf_chat": compare(runs["local-chat-completions"], runs["hf-chat"])}
    for run, v in result["runs"].items():
        print(f"{run:24s} {v['seconds']:7.1f} s  " + "  ".join(f"{t} {m:.4f}" for t, m in v["metrics"].items()))
    for key in ("completions_vs_hf", "chat_vs_hf_chat"):
        for task, c in result[key].items():
            print(f"{key:18s} {task:11s} docs {c['docs']:3d}  answered differently {c['docs_answered_differently']}"
                  f"  max |loglikelihood diff| {c['max_abs_loglikelihood_diff']}")
    if args.out:
        write_json(args.out, {**result, "samples": {k: v["samples"] for k, v in runs.items()}})


if __name__ == "__main__":
    main()
