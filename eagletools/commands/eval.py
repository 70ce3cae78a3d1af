"""`eagletools eval`: acceptance, speedup and losslessness of a draft on a benchmark."""

from __future__ import annotations

import argparse

from eagletools.commands import add_command
from eagletools.commands.generate import add_decoding_args, settings_from_args
from eagletools.engines import ENGINE_TIMEOUT, ENGINES, OURS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "eval", "Benchmark a draft: tau, per-position acceptance, speedup, greedy match",
        "eagletools eval --target smollm2-135m --draft runs/demo/eagle --bench mt-bench "
        "--num-prompts 10 --hf-baseline --output-dir runs/eval",
    )  # fmt: skip
    p.add_argument(
        "--bench",
        default="mt-bench",
        help="mt-bench, humaneval, spec-bench, or a JSONL file of {turns: [...]} / {prompt: ...}",
    )
    p.add_argument("--num-prompts", type=int, help="first N questions (default: all)")
    p.add_argument("--max-turns", type=int, help="first N turns of each question (default: all)")
    p.add_argument("--output-dir", required=True, help="results.json, results.md and PNG plots")
    p.add_argument(
        "--hf-baseline", action="store_true", help="also time Hugging Face generate on each prompt"
    )
    p.add_argument(
        "--autotune",
        action="store_true",
        help="time the tree shapes of the tune (plain decoding among them) on the benchmark's "
        "first --autotune-prompts questions, at --max-new-tokens, and use the fastest",
    )
    p.add_argument(
        "--autotune-prompts", type=int, default=3, help="questions --autotune times the shapes on"
    )
    p.add_argument(
        "--engine",
        default=OURS,
        choices=(OURS, *ENGINES),
        help="decode inside this engine: ours (the tree decoder), or a serving engine started "
        "on 127.0.0.1 (vllm: a speculators/eagle draft; llama.cpp: a GGUF draft), drafting a "
        "chain of --depth tokens; install them with make engine-vllm / engine-llamacpp",
    )
    p.add_argument("--engine-port", type=int, help="port for the engine's server (default: free)")
    p.add_argument(
        "--engine-timeout",
        type=float,
        default=ENGINE_TIMEOUT,
        help="seconds the engine's server may take to start (vLLM compiles on first start)",
    )
    p.add_argument("--wandb", metavar="PROJECT", help="log the run to wandb (offline mode works)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_decoding_args(p)
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from eagletools.eval.questions import load_benchmark
    from eagletools.eval.report import log_wandb, markdown
    from eagletools.eval.runner import evaluate

    questions = load_benchmark(args.bench, args.num_prompts, args.max_turns)
    s = settings_from_args(args)
    results, files = evaluate(s, questions, args.output_dir, progress=not args.no_progress)
    if args.wandb:
        log_wandb(results, files, args.wandb)
    print(markdown(results))
    print("wrote " + ", ".join(str(f) for f in files))
    return 0
