"""Shape-real scale check on CPU: each stage a user runs, at 8B widths, peak memory vs estimate.

Random-weight targets with Llama-3.1-8B's and Qwen3-8B's real widths, heads, head_dim,
MLP and vocabulary in 2 layers (a local folder built from a config: nothing comes from
the hub) go through: online training on 4,096-token sequences in two FSDP2 processes
(gloo), the hidden-state cache, `convert` to eagle, speculators and gguf, and `eval` on
a 16k-token prompt. A Llama-3.1-70B config (80 layers) goes through `convert` and
`inspect` from a folder holding only its config and embedding. Each stage runs in a
child process, so its peak RSS (`ru_maxrss` of that child, the largest process of a
launch) is its own; the estimate beside it is `base` (the RSS of importing what
the stages import, measured) plus the stage's formula, read from docs/walkthrough.md
("Memory per stage") and evaluated as written there, and a stage past twice its
estimate fails the check. Settings (`Settings`): bf16 target, bf16 autocast over an fp32
draft, draft vocabulary 16,000, draft MLP 4,096 wide, 2 TTT steps, 2 optimizer steps of one sequence a rank,
one thread a rank.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scale_check.py --out runs/scale
    ... --preset tiny   # the same stages at toy widths, in seconds (tests/test_scale_check.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
CACHE_BATCH_TOKENS = 8192  # `data hidden-states --batch-tokens`, its default
AUX_IDS = "0,1,2"  # 2 layers: the embedding and both layers' outputs (HF indexing)
AUX = 3  # aux states the draft fuses (docs/design.md 3.1)
GIB = 2**30
# what the stages import before they allocate: the RSS every estimate starts from
BASE_IMPORTS = (
    "import datasets, eagletools.train.trainer, eagletools.decode.engine, eagletools.formats"
)


@dataclass(frozen=True)
class Shape:
    """A target's sizes: what memory depends on (the weights are random)."""

    name: str
    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    max_positions: int
    rope: dict

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.family, hidden_size=self.hidden, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate, vocab_size=self.vocab,
            num_hidden_layers=self.layers, max_position_embeddings=self.max_positions,
            rope_parameters=self.rope, rms_norm_eps=1e-5, tie_word_embeddings=False,
        )  # fmt: skip


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
REAL = {
    "llama3.1-8b": Shape("llama3.1-8b", "llama", 4096, 32, 8, 128, 14336, 128256, 2, 131072,
                         LLAMA31_ROPE),
    "qwen3-8b": Shape("qwen3-8b", "qwen3", 4096, 32, 8, 128, 12288, 151936, 2, 40960,
                      QWEN3_ROPE),
    "llama3.1-70b": Shape("llama3.1-70b", "llama", 8192, 64, 8, 128, 28672, 128256, 80,
                          131072, LLAMA31_ROPE),
}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What a run trains and decodes: the real run's, or the tiny preset's."""

    shapes: dict
    preset: str = "real"
    seq_len: int = 4096  # training and cache sequence length
    prompt_len: int = 16384  # eval prompt tokens (the byte tokenizer: one per character)
    draft_vocab: int = 16000  # the recipes' 32,000 puts two ranks past 24 GB (the estimate)
    # the trained draft's MLP (draft.intermediate_size; default the target's): at 14,336
    # rank 0 gathers 12 Pd = 4.3 GB more for the final checkpoint, and the two ranks OOM
    draft_mlp: int | None = 4096
    ttt_steps: int = 2
    train_steps: int = 2
    processes: int = 2
    new_tokens: int = 4


def tiny_settings() -> Settings:
    """The same stages at toy widths (the smoke test): vocab >= the byte tokenizer's 259."""
    small = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
    shapes = {k: replace(s, **small) for k, s in REAL.items()}
    shapes["llama3.1-70b"] = replace(shapes["llama3.1-70b"], hidden=128, intermediate=256)
    return Settings(shapes, "tiny", seq_len=256, prompt_len=512, draft_vocab=128,
                    draft_mlp=None, train_steps=1)  # fmt: skip


# -- analytical estimates (docs/walkthrough.md, "Memory per stage") ---------------------


def target_params(shape: Shape) -> int:
    """Parameters of the target, counted on the meta device."""
    return _count(lambda: _meta_target(shape))


def draft_params(shape: Shape, draft_vocab: int, mlp: int | None) -> tuple[int, int]:
    """(trained parameters, frozen embedding) of the draft for `shape`."""
    import torch

    from eagletools.draft import Eagle3Draft

    with torch.device("meta"):
        draft = Eagle3Draft(draft_config(shape, draft_vocab, mlp))
    embed = draft.embed_tokens.weight.numel()
    return sum(p.numel() for p in draft.parameters()) - embed, embed


def formulas() -> dict[str, str]:
    """docs/walkthrough.md's estimates as written there: each stage's `NAME = EXPR` line
    ("Memory per stage") and the cache's `bytes per token = EXPR` (step 4)."""
    page = WALKTHROUGH.read_text()
    found = dict(re.findall(r"`(train|cache|convert|eval|big) = ([^`]+)`", page))
    found["bytes_per_token"] = re.search(r"^bytes per token = `([^`]+)`$", page, re.M)[1]
    return found


def estimates(shape: Shape, s: Settings, draft_mlp: int | None = None) -> dict[str, float]:
    """Each stage's peak bytes per process above the import base, and the cache's bytes
    per token, from the walkthrough's formulas and the sizes of `shape` and `s`."""
    pd, embed = draft_params(shape, s.draft_vocab, draft_mlp)
    sizes = dict(
        Pt=target_params(shape), Pd=pd, E=embed, W=s.processes, T=s.seq_len, Vd=s.draft_vocab,
        K=s.ttt_steps, A=AUX, Ht=shape.hidden, I=shape.intermediate, N=CACHE_BATCH_TOKENS,
        L=shape.layers, Hkv=shape.kv_heads, D=shape.head_dim, Tp=s.prompt_len,
        S=s.prompt_len + s.new_tokens,
    )  # fmt: skip
    names = {"__builtins__": {}, "max": max}
    return {name: eval(expr, names, sizes) for name, expr in formulas().items()}


def draft_config(shape: Shape, draft_vocab: int, mlp: int | None = None):
    from eagletools.draft import DraftConfig

    return DraftConfig(
        hidden_size=shape.hidden, intermediate_size=mlp or shape.intermediate,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, vocab_size=shape.vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=shape.hidden, aux_layer_ids=aux_ids(shape),
        rope_theta=shape.rope["rope_theta"], max_position_embeddings=shape.max_positions,
    )  # fmt: skip


def aux_ids(shape: Shape) -> list[int]:
    """The default `[2, N//2, N-3]`, or every state of a 2-layer stand-in."""
    if shape.layers < 4:
        return [int(i) for i in AUX_IDS.split(",")]
    return [2, shape.layers // 2, shape.layers - 3]


def _meta_target(shape: Shape):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape.config())


def _count(make) -> int:
    return sum(p.numel() for p in make().parameters())


# -- inputs, built in children ----------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def byte_tokenizer():
    """A fast Llama-2-style tokenizer of bytes alone (byte fallback, no merges), which
    `convert --to gguf` can describe: one token per ASCII letter, offsets for loss masks."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=CHAT_TEMPLATE)  # fmt: skip


def build_target(shape: Shape, folder: Path) -> None:
    """A random bf16 target folder with a byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagletools.targets.folder import save_target_folder

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape.config(), dtype=torch.bfloat16)
    save_target_folder(model, byte_tokenizer(), folder, torch.bfloat16, overwrite=True)


def build_big_target(shape: Shape, folder: Path, draft_vocab: int) -> None:
    """The 70B target as `convert`/`inspect` read it (config and input embedding only), and
    a random bf16 draft of its width; no 70B weight is ever made."""
    import torch
    from safetensors.torch import save_file

    from eagletools.draft import Eagle3Draft
    from eagletools.formats import Checkpoint, save_checkpoint
    from eagletools.vocab import DraftVocab

    folder.mkdir(parents=True, exist_ok=True)
    config = shape.config()
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    torch.manual_seed(0)
    embed = torch.randn(shape.vocab, shape.hidden, dtype=torch.bfloat16) * 0.02
    save_file({"model.embed_tokens.weight": embed}, str(folder / "model.safetensors"))
    del embed
    with torch.device("meta"):
        draft = Eagle3Draft(draft_config(shape, draft_vocab))
    weights = draft.to_empty(device="cpu").to(torch.bfloat16).state_dict()
    tensors = {name: value.normal_(0, 0.02) if value.dim() > 1 else value.fill_(1.0)
               for name, value in weights.items() if value.is_floating_point()
               and name != "embed_tokens.weight"}  # fmt: skip
    vocab = DraftVocab.from_selected(torch.arange(draft_vocab), shape.vocab)
    out = folder.parent / "big-draft"
    ckpt = Checkpoint(
        "eagle", draft.config, tensors | {"d2t": vocab.d2t, "t2d": vocab.t2d}, str(out)
    )
    save_checkpoint(ckpt, out, "eagle", overwrite=True)


def write_inputs(root: Path, s: Settings) -> None:
    """Training conversations of about `seq_len` tokens and one `prompt_len`-token question."""
    import random

    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrst") for _ in range(n))

    rows = [{"messages": [{"role": "user", "content": text(64)},
                          {"role": "assistant", "content": text(s.seq_len)}]}
            for _ in range(2 * s.processes * s.train_steps)]  # fmt: skip
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    question = {"id": 0, "category": "long", "turns": [text(s.prompt_len)]}
    (root / "questions.jsonl").write_text(json.dumps(question) + "\n")


# -- stages -----------------------------------------------------------------------------


@dataclass
class Row:
    model: str
    stage: str
    peak: float  # bytes, the largest process
    estimate: float  # bytes, base + formula
    seconds: float
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.peak / self.estimate


def run_child(cmd: list[str], log: Path, env: dict | None = None) -> tuple[float, float]:
    """Run `cmd`, its output to `log`: (peak RSS in bytes of its largest process, seconds)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or child_env())
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}); {log}:\n{tail}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagletools.cli", *args]


def me(s: Settings, *args: str) -> list[str]:
    """This script as a child, with the same preset."""
    return [sys.executable, __file__, "--preset", s.preset, *args]


def fsdp_env() -> dict[str, str]:
    """accelerate launch's FSDP2 variables from recipes/accelerate-fsdp.yaml (one thread per
    process: 2 processes on 2 cores)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gloo_helpers import fsdp_launch_env

    return child_env(OMP_NUM_THREADS="1", **fsdp_launch_env())


def train_command(s: Settings, root: Path, work: Path) -> list[str]:
    from eagletools.engines.server import free_port

    torchrun = Path(sys.executable).parent / "torchrun"
    overrides = [
        f"target.spec={work / 'target'}", "target.dtype=bf16", f"target.aux_layer_ids=[{AUX_IDS}]", f"data.train={root / 'train.jsonl'}",
        f"data.max_length={s.seq_len}", "data.eval_samples=0",
        f"vocab.draft_vocab_size={s.draft_vocab}", f"training.ttt_steps={s.ttt_steps}",
        "training.batch_size=1", f"training.max_steps={s.train_steps}", "training.precision=bf16",
        "training.eval_every=0", "training.save_every=0", "tracking.report_to=none",
        f"draft.intermediate_size={s.draft_mlp or 'null'}",
    ]  # fmt: skip
    return [str(torchrun), "--nproc_per_node", str(s.processes), "--master_port",
            str(free_port()), __file__, "--preset", s.preset, "--fsdp-worker", "train", *overrides,
            "--output-dir", str(work / "train")]  # fmt: skip


def run_shape(shape: Shape, s: Settings, root: Path, base: float) -> list[Row]:
    """Every stage for one 8B-shaped target, in order (each needs the one before)."""
    work, est = root / shape.name, estimates(shape, s, s.draft_mlp)
    work.mkdir(parents=True, exist_ok=True)
    rows = []

    def stage(name: str, cmd: list[str], kind: str, env=None, note: str = "") -> None:
        peak, secs = run_child(cmd, work / f"{name}.log", env)
        rows.append(Row(shape.name, name, peak, base + est[kind], secs, note))
        print(f"  {name}: {peak / GIB:.2f} GiB in {secs:.0f} s", flush=True)

    run_child(me(s, "--build", shape.name, str(work / "target")), work / "build.log")
    stage("train (FSDP2 x2)", train_command(s, root, work), "train", fsdp_env())
    cache = work / "cache"
    stage("cache", cli("data", "hidden-states", "--target", str(work / "target"),
                       "--data", str(root / "train.jsonl"), "--num-samples", "2",
                       "--max-length", str(s.seq_len), "--aux-layer-ids", AUX_IDS, "--dtype", "bf16", "--device", "cpu",
                       "--output-dir", str(cache)), "cache")  # fmt: skip
    measured = re.search(r"(\d+) bytes per token", (work / "cache.log").read_text())
    rows[-1].note = (f"{measured.group(1) if measured else '?'} B/token "
                     f"(formula {est['bytes_per_token']:.0f})")  # fmt: skip
    final = work / "train" / "final"
    for fmt, out in (("eagle", "eagle"), ("speculators", "speculators"), ("gguf", "draft.gguf")):
        stage(f"convert {fmt}", cli("convert", str(final), str(work / out), "--to", fmt,
                                    "--target", str(work / "target"), "--dtype", "bf16",
                                    "--force"), "convert")  # fmt: skip
    stage("eval (16k prompt)", cli("eval", "--target", str(work / "target"), "--draft",
                                   str(work / "eagle"), "--bench", str(root / "questions.jsonl"),
                                   "--num-prompts", "1", "--max-new-tokens", str(s.new_tokens),
                                   "--topk", "2", "--depth", "2", "--num-draft-tokens", "4",
                                   "--device", "cpu", "--dtype", "bf16", "--no-progress",
                                   "--output-dir", str(work / "eval")), "eval")  # fmt: skip
    return rows


def run_big(shape: Shape, s: Settings, root: Path, base: float) -> list[Row]:
    """The 70B config: `convert` and `inspect` from config + embedding, never its weights."""
    work, est = root / shape.name, estimates(shape, s)
    work.mkdir(parents=True, exist_ok=True)
    target = work / "target"
    run_child(me(s, "--build-big", shape.name, str(target), str(s.draft_vocab)), work / "build.log")
    rows = []
    for name, cmd in (
        ("convert speculators", cli("convert", str(work / "big-draft"), str(work / "speculators"),
                                    "--to", "speculators", "--target", str(target),
                                    "--dtype", "bf16", "--force")),
        ("inspect", cli("inspect", str(work / "speculators"), "--target", str(target))),
    ):  # fmt: skip
        peak, secs = run_child(cmd, work / f"{name.split()[0]}.log")
        rows.append(Row(shape.name, name, peak, base + est["big"], secs))
        print(f"  {name}: {peak / GIB:.2f} GiB in {secs:.0f} s", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| target | stage | peak RSS GiB | estimate GiB | peak/est | wall s | note |",
             "|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.model} | {r.stage} | {r.peak / GIB:.2f} | {r.estimate / GIB:.2f} | "
                     f"{r.ratio:.2f} | {r.seconds:.0f} | {r.note} |")  # fmt: skip
    return "\n".join(lines)


def fsdp_worker(argv: list[str]) -> None:
    """One torchrun rank of `eagletools <argv>` under FSDP2 on CPU processes: accelerate
    alone would make an FSDP launch without GPUs DDP (tests/gloo_helpers.fsdp_on_cpu)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gloo_helpers import fsdp_on_cpu

    from eagletools.cli import main as eagletools_main

    fsdp_on_cpu()
    rc = eagletools_main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # FSDP2 keeps gloo threads that may abort interpreter exit (gloo_helpers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/scale"))
    parser.add_argument("--preset", choices=("real", "tiny"), default="real")
    parser.add_argument("--models", nargs="+", default=["llama3.1-8b", "qwen3-8b"],
                        choices=["llama3.1-8b", "qwen3-8b"])  # fmt: skip
    parser.add_argument("--no-big", action="store_true", help="skip the 70B convert/inspect")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--draft-vocab", type=int, help="training's draft vocabulary (16,000)")
    parser.add_argument("--ttt-steps", type=int, help="training's TTT steps (2)")
    parser.add_argument("--build", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--build-big", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp-worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    s = tiny_settings() if args.preset == "tiny" else Settings(REAL)
    s = replace(s, draft_vocab=args.draft_vocab or s.draft_vocab,
                ttt_steps=args.ttt_steps or s.ttt_steps)  # fmt: skip
    if args.fsdp_worker:
        return fsdp_worker(args.fsdp_worker)
    if args.build:
        return build_target(s.shapes[args.build[0]], Path(args.build[1]))
    if args.build_big:
        name, folder, vocab = args.build_big
        return build_big_target(s.shapes[name], Path(folder), int(vocab))
    args.out.mkdir(parents=True, exist_ok=True)
    write_inputs(args.out, s)
    base, _ = run_child([sys.executable, "-c", BASE_IMPORTS], args.out / "base.log")
    print(f"base ({BASE_IMPORTS}): {base / GIB:.2f} GiB", flush=True)
    rows = []
    for name in args.models:
        print(name, flush=True)
        rows += run_shape(s.shapes[name], s, args.out, base)
    if not args.no_big:
        print("llama3.1-70b", flush=True)
        rows += run_big(s.shapes["llama3.1-70b"], s, args.out, base)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    over = [r for r in rows if r.ratio > 2 and s.preset == "real"]  # toy widths: all base
    if over:
        raise SystemExit(
            "over twice the estimate: " + ", ".join(f"{r.model} {r.stage}" for r in over)
        )


if __name__ == "__main__":
    main()
