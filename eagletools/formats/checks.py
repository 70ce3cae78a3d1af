"""The static checks of `eagletools doctor`: every way an engine would serve this draft
wrongly that its files show, one line each.

A draft that loads is not a draft that works: engines read config fields with
their own defaults and precedence, and a wrong field, a NaN or a shifted aux id
raises nothing; acceptance just falls to ~1. The checks below read the files
as written (not eagletools' normalised `DraftConfig`, which would hide a field
two readers see differently), then reuse what exists: the loader's tensor and
vocabulary checks, `validate.target_problems` with a target, the engine-option
table (`formats.engines`) with an engine. Running the draft on the target is
`eagletools.doctor`'s, a layer up. `convert` runs `static_findings` on its
input and refuses what it would otherwise launder (`refuse_or_repair`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.errors import UserError
from eagletools.formats import eagle, gguf, hfconfig, speculators, training
from eagletools.formats.checkpoint import Checkpoint, detect_format, load_checkpoint, sniff_format
from eagletools.formats.record import find_record
from eagletools.formats.tensors import read_tensors
from eagletools.kinds import KINDS
from eagletools.targets import default_aux_layer_ids, normalize_rope_scaling, rope_of
from eagletools.targets.anatomy import DEFAULT_ROPE_THETA

LEVELS = ("ok", "info", "warn", "error")
NBR = "norm_before_residual"
NBF = "norm_before_fc"
AUX = "eagle_aux_hidden_state_layer_ids"
# the layouts each engine loads (llama.cpp: any, through `convert --to gguf`)
LAYOUTS = {"vllm": {"eagle", "speculators"}, "llama.cpp": {"eagle", "speculators", "training"}}
EAGLE_ONLY = {"eagle"}


@dataclass
class Finding:
    """One check's verdict: level ok/info/warn/error, the field or tensor, the fix;
    `repair` says what `convert --repair` changes (unambiguous faults only)."""

    check: str
    level: str
    field: str
    message: str
    fix: str = ""
    engine: str | None = None
    repair: str | None = None

    def line(self) -> str:
        where = f"[{self.engine}] " if self.engine else ""
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.level:5} {where}{self.check}: {self.field}: {self.message}{fix}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Draft:
    """A checkpoint as its files hold it, and as eagletools reads it (None if it cannot)."""

    path: Path
    format: str
    raw: dict[str, Any]  # config.json (draft_config.json for `training`) as written
    layer: dict[str, Any]  # the decoder layer's section of `raw`
    tensors: dict[str, torch.Tensor]  # as stored, by the file's names
    ckpt: Checkpoint | None
    load_error: str | None
    record: dict[str, Any] | None

    @property
    def is_dflash(self) -> bool:
        """A DFlash draft, whose layers have none of the EAGLE heads' options."""
        kind = self.ckpt.config.kind if self.ckpt else self.raw.get("speculators_model_type")
        return kind == "dflash"

    @property
    def trained(self) -> dict[str, Any]:
        """The trained options: the training record's, else as eagletools reads them."""
        ours = self.ckpt.config.to_dict() if self.ckpt else {}
        return {**ours, **((self.record or {}).get("draft") or {})}


def read_draft(
    path: str | Path, allow_pickle: bool = False, ckpt: Checkpoint | None = None
) -> Draft:
    """The files at `path` (any readable format), read twice: raw, and through the loader
    (unless the caller already has `ckpt`)."""
    path = Path(path).expanduser()
    fmt = sniff_format(path)
    if fmt is None or fmt == gguf.NAME:
        detect_format(path)  # names what is there and what was expected
        raise UserError(f"{path}: a GGUF file, which only `eagletools doctor` reads by itself; "
                        "give the folder it was converted from")  # fmt: skip
    config_file = path / (training.CONFIG if fmt == training.NAME else "config.json")
    raw = hfconfig.read_json(config_file)
    layer = (raw.get("transformer_layer_config") or {}) if fmt == speculators.NAME else raw
    error = None
    try:
        ckpt = ckpt or load_checkpoint(path, allow_pickle)
    except UserError as err:
        error = str(err)
    tensors = read_tensors(path, allow_pickle)
    return Draft(
        path,
        fmt,
        raw,
        layer,
        tensors,
        ckpt,
        error,
        find_record(path, ckpt.config) if ckpt else None,
    )


# -- static checks, every engine ------------------------------------------------------


def check_load(d: Draft) -> list[Finding]:
    if d.load_error:
        return [Finding("load", "error", "checkpoint", d.load_error,
                        "re-export the draft from its training checkpoint")]  # fmt: skip
    return [Finding("load", "ok", "checkpoint", f"{d.format} layout; tensors, shapes and d2t/t2d check out")]  # fmt: skip


def check_finite(d: Draft) -> list[Finding]:
    """A NaN or inf in any weight: every engine loads it and proposes garbage."""
    out = []
    for name, t in sorted(d.tensors.items()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            out.append(Finding("finite", "error", name, f"{bad} of {t.numel()} values are NaN or inf",
                               "re-export from a checkpoint saved before the fault (a NaN "
                               "step, a bad cast to fp16)"))  # fmt: skip
    return out or [Finding("finite", "ok", "tensors", f"all {len(d.tensors)} finite")]


def transformers5_rope(layer: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE as the installed transformers (5.x) builds it from these fields: a non-null
    `rope_scaling` wins over `rope_parameters`, which wins over `rope_theta`."""
    from transformers import LlamaConfig

    fields = {k: copy.deepcopy(layer[k]) for k in ("rope_parameters", "rope_theta", "rope_scaling") if k in layer}  # fmt: skip
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, **fields)
    return rope_of({"rope_parameters": config.rope_parameters})


def rope_readings(layer: dict[str, Any]) -> dict[str, tuple[float, dict[str, Any] | None]]:
    """Who reads which RoPE from one config: eagletools, transformers 4 and 5."""
    import transformers

    t4 = (float(layer.get("rope_theta") or DEFAULT_ROPE_THETA), normalize_rope_scaling(layer.get("rope_scaling")))  # fmt: skip
    out = {"eagletools (rope_parameters first)": rope_of(layer), "transformers 4 (rope_theta, rope_scaling; no rope_parameters)": t4}  # fmt: skip
    if int(transformers.__version__.split(".")[0]) >= 5:
        out[f"transformers {transformers.__version__}"] = transformers5_rope(layer)
    return out


def check_rope(d: Draft) -> list[Finding]:
    """`rope_parameters` against `rope_theta`/`rope_scaling`: each generation reads another."""
    if d.format == training.NAME:
        return []
    readings = rope_readings(d.layer)
    if len({repr(v) for v in readings.values()}) == 1:
        theta, scaling = next(iter(readings.values()))
        return [
            Finding("rope", "ok", "rope", f"every reader gets theta {theta}, scaling {scaling}")
        ]
    seen = "; ".join(f"{who}: theta {t}, scaling {s}" for who, (t, s) in readings.items())
    return [Finding("rope", "error", "rope_parameters / rope_theta / rope_scaling",
                    f"the spellings disagree, so engines run another RoPE than eagletools: {seen}",
                    "convert with --target --repair to write the target's RoPE in both spellings",
                    repair="RoPE taken from --target, written in both spellings")]  # fmt: skip


def check_architectures(d: Draft) -> list[Finding]:
    """The class an engine builds is picked by `architectures`: the draft's kind's for
    its layout."""
    kind = KINDS.get(d.ckpt.config.kind if d.ckpt else "eagle3")
    want = set(kind.architectures.get(d.format, ())) if kind else set()
    if not want:
        return []
    archs = d.raw.get("architectures") or []
    if want & set(archs):
        return [Finding("architectures", "ok", "architectures", str(archs))]
    return [Finding("architectures", "error", "architectures",
                    f"{archs}, expected {sorted(want)} for the {d.format} layout: engines pick the "
                    "model class by it and load another model (or refuse)",
                    "convert --repair rewrites it", repair=f"architectures set to {sorted(want)}")]  # fmt: skip


def check_tie(d: Draft) -> list[Finding]:
    """`tie_word_embeddings` true: SGLang's llama_eagle3 uses embed_tokens as the head."""
    if d.format == training.NAME:
        return []
    places = {"tie_word_embeddings": d.raw}
    if d.layer is not d.raw:
        places["transformer_layer_config.tie_word_embeddings"] = d.layer
    tied = [field for field, section in places.items() if section.get("tie_word_embeddings")]
    if not tied:
        return [Finding("tie", "ok", "tie_word_embeddings", "false or absent")]
    return [Finding("tie", "error", tied[0],
                    "true on a draft, whose lm_head is its own over the draft vocabulary: SGLang's "
                    "llama_eagle3 then uses embed_tokens (the target's) as the head",
                    "convert --repair writes false", repair="tie_word_embeddings set to false")]  # fmt: skip


def _weights_dtype(tensors: dict[str, torch.Tensor]) -> str | None:
    """The float dtype holding most of the weights, as configs spell it."""
    sizes: Counter[str] = Counter()
    for t in tensors.values():
        if t.is_floating_point():
            sizes[str(t.dtype).removeprefix("torch.")] += t.numel()
    return sizes.most_common(1)[0][0] if sizes else None


def check_dtype(d: Draft) -> list[Finding]:
    """`dtype`/`torch_dtype` against the tensors: engines load at the field's dtype."""
    if d.format == training.NAME:
        return []
    stored = _weights_dtype(d.tensors)
    fields = {f: d.raw[f] for f in ("dtype", "torch_dtype") if d.raw.get(f)}
    wrong = {f: v for f, v in fields.items() if v != stored}
    if not wrong:
        return [Finding("dtype", "ok", "dtype", f"weights {stored}, config {fields or 'silent'}")]
    field, value = next(iter(wrong.items()))
    return [Finding("dtype", "error", field,
                    f"{value!r}, but the weights are {stored}: an engine loading at the field's "
                    "dtype casts them (fp16 overflows where bf16 did not)",
                    "convert --repair writes the weights' dtype", repair=f"{field} set to {stored}")]  # fmt: skip


def check_norm_before_residual(d: Draft) -> list[Finding]:
    """Absent, engines differ: vLLM reads a speculators config as true, an eagle one as
    `getattr(config, 'norm_before_residual', False)`; speculators assumes false."""
    if d.format == training.NAME or d.is_dflash:
        return []  # a DFlash draft has no such option
    trained = (d.record or {}).get("draft", {}).get(NBR)
    present = NBR in d.raw
    if present and (trained is None or bool(d.raw[NBR]) == trained):
        return [Finding(NBR, "ok", NBR, str(d.raw[NBR]))]
    if trained is not None:
        state = f"is {d.raw[NBR]}" if present else "is absent"
        return [Finding(NBR, "error", NBR,
                        f"{state}, but the draft was trained with {trained} (acceptance.json); "
                        "vLLM reads an eagle config without it as false, a speculators one as true",
                        "convert --repair writes the trained value", repair=f"{NBR} set to {trained}")]  # fmt: skip
    if d.format == speculators.NAME:
        return [Finding(NBR, "warn", NBR,
                        "absent: vLLM assumes true, the speculators package false, so the same "
                        "file runs two networks", "re-export with the field set (convert writes it)")]  # fmt: skip
    return [Finding(NBR, "info", NBR, "absent: engines read false (the original EAGLE-3 head)")]


def aux_spellings(raw: dict[str, Any]) -> dict[str, list[int]]:
    """Each place a config states aux ids, as HF hidden-state indices (docs/design.md 3.1)."""
    out = {}
    if raw.get(AUX):
        out[AUX] = list(raw[AUX])
    inner = (raw.get("eagle_config") or {}).get(AUX)
    if inner:
        out[f"eagle_config.{AUX}"] = eagle.to_hf_ids(inner)
    return out


def check_aux_spellings(d: Draft) -> list[Finding]:
    """Top-level ids (vLLM, HF indexing) beside eagle_config ids (SGLang, +1) must agree,
    and with the ids training recorded: a shift by one is otherwise invisible."""
    spellings = aux_spellings(d.raw) if d.format != training.NAME else {}
    if len({tuple(v) for v in spellings.values()}) > 1:
        seen = "; ".join(f"{k} means {v}" for k, v in spellings.items())
        return [Finding("aux", "error", "aux_layer_ids",
                        f"the spellings disagree, in HF indexing: {seen}; vLLM reads the first, "
                        "SGLang the second plus one", "keep one: re-export from the training checkpoint")]  # fmt: skip
    read = d.ckpt.config.aux_layer_ids if d.ckpt else None
    trained = (d.record or {}).get("draft", {}).get("aux_layer_ids")
    if trained and read and list(trained) != list(read):
        where = next(iter(spellings), "aux_layer_ids")
        return [Finding("aux", "error", where,
                        f"means {read} (HF indexing), but the draft was trained on {trained} "
                        "(acceptance.json): shifted between conventions (eagle_config ids are "
                        "decoder-layer outputs, HF index - 1)",
                        "re-export from the training checkpoint")]  # fmt: skip
    return [Finding("aux", "ok", "aux_layer_ids", f"{read} (HF indexing)" if read else "not recorded")]  # fmt: skip


def nbf_readings(d: Draft) -> dict[str, tuple[str, bool]]:
    """`norm_before_fc` as each reader of this layout takes it: reader -> (field, value).
    In the eagle layout vLLM reads `eagle_config`'s, else the top-level one
    (models/llama_eagle3.py:184-188); TensorRT-LLM `eagle_config`'s only; llama.cpp's
    converter the top-level one only (conversion/llama.py:102)."""
    top = bool(d.raw.get(NBF, False))
    if d.format != eagle.NAME:
        who = "vLLM and speculators" if d.format == speculators.NAME else "eagletools"
        return {who: (NBF, top)}
    inner = (d.raw.get("eagle_config") or {}).get(NBF)
    return {
        "vLLM": (f"eagle_config.{NBF}", bool(inner)) if inner is not None else (NBF, top),
        "TensorRT-LLM": (f"eagle_config.{NBF}", bool(inner)),
        "llama.cpp's converter": (NBF, top),
    }


def check_norm_before_fc(d: Draft) -> list[Finding]:
    """`norm_before_fc` against its tensor `input_norm.weight`, as each reader takes the
    flag: with the flag off vLLM drops the tensor and serves the draft without the norm
    (models/llama_eagle3.py:464); with it on and no tensor, speculators runs a norm of
    ones. Only the spellings disagreeing (the vLLM reading right) is repairable."""
    has = hfconfig.INPUT_NORM in d.tensors
    readings = nbf_readings(d)
    wrong = {who: fv for who, fv in readings.items() if fv[1] != has}
    if not wrong:
        state = f"on, with {hfconfig.INPUT_NORM}" if has else f"off, no {hfconfig.INPUT_NORM}"
        return [Finding(NBF, "ok", NBF, state)]
    repair = None
    if d.format == eagle.NAME and "vLLM" not in wrong:
        repair = f"{NBF} written top-level and in eagle_config"
    out = []
    for who, (field, value) in wrong.items():
        what, fix = hfconfig.input_norm_problem(value, has, field, who)
        if repair:
            fix = f"convert --repair writes {NBF} in both places"
        out.append(Finding(NBF, "error", field, what, fix, repair=repair))
    return out


STATIC_CHECKS = (check_load, check_finite, check_rope, check_architectures, check_tie,
                 check_dtype, check_norm_before_residual, check_aux_spellings,
                 check_norm_before_fc)  # fmt: skip


def static_findings(d: Draft) -> list[Finding]:
    """What every engine depends on, from the files alone."""
    return [f for check in STATIC_CHECKS for f in check(d)]


# -- a GGUF file (llama.cpp) -----------------------------------------------------------


def _gguf_tensor(t: Any) -> torch.Tensor | None:
    """A GGUF tensor's values: floats and ints as stored, bf16 from its raw bytes;
    None for a quantised type (its blocks are not checked)."""
    import numpy as np
    from gguf import GGMLQuantizationType

    data = np.asarray(t.data)
    if t.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(data.copy()) if data.dtype.kind in "fi" else None


def gguf_findings(path: Path) -> list[Finding]:
    """What applies to a GGUF draft: finite tensors, exactly 3 `eagle3.target_layers`,
    `d2t` as absolute target ids (strictly increasing, below the vocabulary size)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: v for t in reader.tensors if (v := _gguf_tensor(t)) is not None}
    d = Draft(path, gguf.NAME, {}, {}, tensors, None, None, None)
    out = check_finite(d)
    field = reader.fields.get(f"{gguf.ARCH}.target_layers")
    layers = list(field.contents()) if field is not None else []
    level = "ok" if len(layers) == 3 else "error"
    out.append(Finding("aux", level, f"{gguf.ARCH}.target_layers", f"{layers} (HF indexing)",
                       "" if level == "ok" else "convert --to gguf writes exactly 3"))  # fmt: skip
    d2t, vocab = tensors.get("d2t"), reader.fields.get(f"{gguf.ARCH}.vocab_size")
    if d2t is not None and vocab is not None:
        ids, size = d2t.long(), int(vocab.contents())
        absolute = (
            bool((ids[1:] > ids[:-1]).all()) and int(ids.min()) >= 0 and int(ids.max()) < size
        )
        out.append(Finding("vocab", "ok" if absolute else "error", "d2t",
                           "absolute target ids" if absolute else "not strictly increasing ids "
                           f"in [0, {size}): offsets, or ids out of order; llama.cpp reads absolute ids",
                           "" if absolute else "convert --to gguf from the folder (it writes i + d2t[i])"))  # fmt: skip
    return out


# -- per engine ----------------------------------------------------------------------


def engine_aux_ids(d: Draft, engine: str, layers: int | None) -> tuple[list[int] | None, str]:
    """(the aux ids `engine` captures for this file, HF indexing; why). None: the engine
    takes the default and the target's layer count is unknown."""
    from eagletools.formats.engines import OPTIONS

    default = default_aux_layer_ids(layers) if layers else None
    honoured = next(o for o in OPTIONS if o.name == "aux_layer_ids").cells[engine].honoured
    spellings = aux_spellings(d.raw)
    if engine == "llama.cpp":
        return d.ckpt.config.aux_layer_ids or default, "convert --to gguf writes the trained ids"
    if not honoured:
        return default, "it captures the default [2, N//2, N-3] whatever the draft says"
    if engine == "vllm":
        ids = spellings.get(AUX)
        return (ids, f"top-level {AUX}") if ids else (default, f"no top-level {AUX}: the default")
    ids = spellings.get(f"eagle_config.{AUX}")  # SGLang: eagle_config ids plus one
    return (
        (ids, f"eagle_config.{AUX} plus one")
        if ids
        else (default, "no eagle_config ids: the default")
    )


def check_engine_aux(d: Draft, engine: str, layers: int | None) -> list[Finding]:
    trained = d.ckpt.config.aux_layer_ids or (default_aux_layer_ids(layers) if layers else None)
    got, why = engine_aux_ids(d, engine, layers)
    if got is None or trained is None:
        return [Finding("aux", "info", "aux_layer_ids", f"not compared ({why}); pass --target", engine=engine)]  # fmt: skip
    if got == trained:
        return [Finding("aux", "ok", "aux_layer_ids", f"captures {got} (HF indexing): {why}", engine=engine)]  # fmt: skip
    fix = {"vllm": f"convert --to speculators (it writes the top-level {AUX})",
           "sglang": "convert --to eagle (it writes eagle_config ids, HF index - 1)"}.get(
        engine, "serve with an engine that reads the draft's ids (docs/formats.md)")  # fmt: skip
    return [Finding("aux", "error", "aux_layer_ids",
                    f"captures {got} ({why}), the draft was trained on {trained} (HF indexing): "
                    "it gets the wrong hidden states and acceptance collapses", fix, engine=engine)]  # fmt: skip


def check_engine_nbr(d: Draft, engine: str) -> list[Finding]:
    """vLLM's reading of `norm_before_residual` in this layout, against the trained value."""
    if engine != "vllm" or d.is_dflash:
        return []  # the others ignore the option (check_engine_options names it); DFlash has none
    read = bool(d.raw.get(NBR, d.format == speculators.NAME))
    trained = bool(d.trained.get(NBR, False))
    if read == trained:
        return [Finding(NBR, "ok", NBR, f"read as {read}", engine=engine)]
    return [Finding(NBR, "error", NBR, f"read as {read} in the {d.format} layout, trained with {trained}",
                    "write the field (convert --repair, or --to speculators)", engine=engine)]  # fmt: skip


def check_engine_options(d: Draft, engine: str, layers: int | None) -> list[Finding]:
    """The engine-option table's verdict (formats.engines), aux ids left to check_engine_aux."""
    from eagletools.formats.engines import unsupported

    ignored = [o for o in unsupported(d.ckpt.config, engine, layers) if o.name != "aux_layer_ids"]
    out = [Finding("options", "error", o.name,
                   f"the draft uses it and {engine} ignores it: another network, no error",
                   f"retrain with {o.recipe_field} off, or serve with an engine that honours it",
                   engine=engine) for o in ignored]  # fmt: skip
    return out or [Finding("options", "ok", "draft options", "all honoured", engine=engine)]


def engine_findings(d: Draft, engine: str, layers: int | None) -> list[Finding]:
    if d.ckpt is None:
        return []
    if d.format not in LAYOUTS.get(engine, EAGLE_ONLY):
        return [Finding("layout", "error", "format", f"{engine} does not load the {d.format} layout",
                        "convert --to eagle", engine=engine)]  # fmt: skip
    return (check_engine_options(d, engine, layers) + check_engine_aux(d, engine, layers)
            + check_engine_nbr(d, engine))  # fmt: skip


# -- with the target ------------------------------------------------------------------


def target_findings(d: Draft, summary: Any) -> list[Finding]:
    """`validate.target_problems`, one finding each."""
    from eagletools.formats.validate import target_problems

    if d.ckpt is None:
        return []
    problems = target_problems(d.ckpt.config, d.ckpt.tensors, summary)
    out = [Finding("target", "error" if p.error else "warn", p.field, p.message, p.fix) for p in problems]  # fmt: skip
    return out or [Finding("target", "ok", "target", f"fits {summary.info.name_or_path}")]


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['path']}: {report['format']} layout"]
    lines += [Finding(**f).line() for f in report["findings"]]
    errors = sum(f["level"] == "error" for f in report["findings"])
    warns = sum(f["level"] == "warn" for f in report["findings"])
    lines.append(f"{errors} error(s), {warns} warning(s)")
    return "\n".join(lines)


# -- convert never launders -----------------------------------------------------------


def refuse_or_repair(
    src: str | Path, ckpt: Checkpoint, repair: bool, has_target: bool, allow_pickle: bool = False
) -> tuple[Checkpoint, list[str]]:
    """Run the static checks on `src`; raise naming each error unless `repair` may fix
    every one (RoPE only with a target to take it from). Returns the checkpoint to
    write (the trained `norm_before_residual` restored) and a line per repair."""
    d = read_draft(src, allow_pickle, ckpt)
    errors = [f for f in static_findings(d) if f.level == "error"]
    fixable = [f for f in errors if f.repair and (f.check != "rope" or has_target)]
    if not errors or (repair and len(fixable) == len(errors)):
        if errors and NBR in d.trained and any(f.check == NBR for f in errors):
            ckpt = dataclasses.replace(
                ckpt, config=dataclasses.replace(ckpt.config, **{NBR: d.trained[NBR]})
            )
        return ckpt, [f"repaired {f.field}: {f.repair}" for f in errors]
    hint = " (--repair fixes the marked ones)" if fixable else ""
    lines = [f"{f.field}: {f.message}; fix: {f.fix}" + (" [--repair]" if f in fixable else "") for f in errors]  # fmt: skip
    raise UserError(
        f"{src}: refusing to write a clean config over a faulty one{hint}:\n  " + "\n  ".join(lines)
    )
