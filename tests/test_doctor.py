"""`eagletools doctor`: every fault family of issue 61, seeded one at a time into copies of
a clean tiny draft in both layouts, is caught with the field or tensor named; the clean
drafts raise nothing; `convert` refuses (or, with --repair, fixes and says) each fault
it would otherwise launder into a clean config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file, save_file
from test_formats import make_ckpt, save_target_folder
from test_gguf import case  # noqa: F401  (the GGUF fixture: a target with a tokenizer)

from eagletools.cli import main
from eagletools.doctor import doctor
from eagletools.errors import UserError
from eagletools.formats import save_checkpoint
from eagletools.formats.convert import convert
from eagletools.formats.record import RECORD, find_record

LAYERS = 6
AUX = [2, 3, 3]  # the default for 6 layers, HF indexing
SHIFTED = [3, 4, 4]
LAYOUTS = ("eagle", "speculators")
Q_PROJ = {"eagle": "midlayer.self_attn.q_proj.weight", "speculators": "layers.0.self_attn.q_proj.weight"}  # fmt: skip


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A 6-layer tiny Llama the clean drafts fit (RoPE, positions, widths, vocab)."""
    model = tiny_model("llama", num_hidden_layers=LAYERS, max_position_embeddings=512)
    return save_target_folder(tmp_path_factory.mktemp("target"), model)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A clean draft in each layout, trained with norm_before_residual, with its record."""
    root = tmp_path_factory.mktemp("clean")
    ckpt = make_ckpt(aux_layer_ids=AUX, max_position_embeddings=512, norm_before_residual=True)
    record = {"acc": [0.5, 0.4], "draft": {"norm_before_residual": True, "aux_layer_ids": AUX}}
    for layout in LAYOUTS:
        save_checkpoint(ckpt, root / layout, layout)
        (root / layout / RECORD).write_text(json.dumps(record))
    return root


def seeded(clean: Path, tmp_path: Path, layout: str, config=None, tensors=None) -> Path:
    """A copy of the clean draft with one fault: `config(dict)` / `tensors(dict)` edit it."""
    folder = tmp_path / f"{layout}-fault"
    shutil.copytree(clean / layout, folder)
    if config:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, folder / "model.safetensors")
    return folder


def layer(data: dict) -> dict:
    """The decoder layer's section of either layout's config."""
    return data.get("transformer_layer_config", data)


def findings(report: dict, level: str = "error") -> list[dict]:
    return [f for f in report["findings"] if f["level"] == level]


def nan_weight(layout):
    return lambda t: t[Q_PROJ[layout]].view(-1)[0].fill_(float("nan"))


def swap_k_v(t):
    key = next(k for k in t if k.endswith("self_attn.k_proj.weight"))
    value = key.replace("k_proj", "v_proj")
    t[key], t[value] = t[value], t[key]


def transpose_o(t):
    key = next(k for k in t if k.endswith("self_attn.o_proj.weight"))
    t[key] = t[key].t().contiguous()


def shift_aux(data):
    if "eagle_config" in data:
        data["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in SHIFTED]
    else:
        data["eagle_aux_hidden_state_layer_ids"] = SHIFTED


# (name, config edit, the field or tensor the error names; None: the layout's own)
CONFIG_FAULTS = {
    "rope_theta alone": (lambda c: layer(c).update(rope_theta=500000.0), "rope_theta"),
    "rope_scaling alone": (
        lambda c: layer(c).update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "rope_scaling",
    ),
    "tie_word_embeddings": (
        lambda c: layer(c).update(tie_word_embeddings=True),
        "tie_word_embeddings",
    ),  # fmt: skip
    "architectures": (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
    "dtype": (lambda c: c.update(torch_dtype="float16", dtype="float16"), "dtype"),
    "norm_before_residual removed": (
        lambda c: c.pop("norm_before_residual"),
        "norm_before_residual",
    ),  # fmt: skip
    "aux ids shifted by one": (shift_aux, "eagle_aux_hidden_state_layer_ids"),
    "aux spellings disagree": (
        lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=SHIFTED,
            eagle_config={"eagle_aux_hidden_state_layer_ids": AUX[:1] * 3},
        ),
        "aux_layer_ids",
    ),  # fmt: skip
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_drafts_pass_every_engine_with_no_warning(clean, target_dir, layout, capsys):
    report = doctor(clean / layout, str(target_dir), ["vllm", "sglang", "llama.cpp"], numeric=False)
    noisy = [f for f in report["findings"] if f["level"] in ("warn", "error")]
    # SGLang loads only the eagle layout and ignores norm_before_residual: both correct refusals
    expected = {("layout", "sglang")} if layout == "speculators" else {("options", "sglang")}
    assert {(f["check"], f["engine"]) for f in noisy} == expected, noisy
    assert main(["doctor", str(clean / layout), "--target", str(target_dir), "--no-numeric"]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", sorted(CONFIG_FAULTS))
def test_config_faults_are_caught_with_the_field_named(clean, tmp_path, layout, fault, capsys):
    edit, field = CONFIG_FAULTS[fault]
    folder = seeded(clean, tmp_path, layout, config=edit)
    report = doctor(folder)
    errors = findings(report)
    assert errors and not report["ok"], report
    assert any(field in f["field"] for f in errors), errors
    assert all(f["fix"] for f in errors)
    assert main(["doctor", str(folder)]) == 1
    assert field in capsys.readouterr().out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_nan_weight_is_named_as_stored(clean, tmp_path, layout):
    report = doctor(seeded(clean, tmp_path, layout, tensors=nan_weight(layout)))
    assert [f["field"] for f in findings(report)] == [Q_PROJ[layout]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loader_faults_and_foreign_embeddings_are_reported(clean, tmp_path, target_dir, layout):
    missing = seeded(clean, tmp_path, layout, tensors=lambda t: t.pop("lm_head.weight"))
    [error] = findings(doctor(missing))
    assert error["check"] == "load" and "lm_head.weight" in error["message"]
    shutil.rmtree(missing)
    foreign = seeded(clean, tmp_path, layout,
                     tensors=lambda t: t.update({"embed_tokens.weight": torch.randn(256, 64)}))  # fmt: skip
    warnings = findings(doctor(foreign, str(target_dir), numeric=False), "warn")
    assert [f["field"] for f in warnings] == ["embed_tokens"]


def test_engines_read_aux_ids_by_their_own_convention(tmp_path, target_dir):
    """An eagle folder's ids sit in eagle_config: SGLang reads them (+1), vLLM only a
    top-level field, so non-default ids are lost there; sgl-jax takes the default."""
    ckpt = make_ckpt(aux_layer_ids=[1, 2, 4], max_position_embeddings=512)
    save_checkpoint(ckpt, tmp_path / "eagle", "eagle")
    report = doctor(tmp_path / "eagle", str(target_dir), ["vllm", "sglang", "sgl-jax"], False)
    aux = {f["engine"]: f for f in report["findings"] if f["check"] == "aux" and f["engine"]}
    assert aux["sglang"]["level"] == "ok"
    assert aux["vllm"]["level"] == "error" and "[2, 3, 3]" in aux["vllm"]["message"]
    assert "--to speculators" in aux["vllm"]["fix"]
    assert aux["sgl-jax"]["level"] == "error"
    save_checkpoint(ckpt, tmp_path / "spec", "speculators")
    report = doctor(tmp_path / "spec", str(target_dir), ["vllm"], False)
    assert report["ok"], findings(report)


# norm_before_fc against its tensor: with the flag off vLLM drops input_norm.weight and serves
# the draft without the norm (models/llama_eagle3.py:464), no error; with it on and no
# tensor, speculators runs a norm of ones
NBF_FAULTS = {
    "input_norm without the flag": (
        None,
        lambda t: t.update({"input_norm.weight": torch.rand(3 * 64) + 0.5}),
        "set norm_before_fc: true",
    ),
    "the flag without input_norm": (
        lambda c: c.update(norm_before_fc=True),
        None,
        "set norm_before_fc: false",
    ),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", sorted(NBF_FAULTS))
def test_norm_before_fc_and_its_tensor_disagreeing_is_caught(clean, tmp_path, layout, fault,
                                                             capsys):  # fmt: skip
    edit, tensors, fix = NBF_FAULTS[fault]
    folder = seeded(clean, tmp_path, layout, config=edit, tensors=tensors)
    report = doctor(folder)
    errors = [f for f in findings(report) if f["check"] == "norm_before_fc"]
    assert any(f["field"] == "norm_before_fc" and fix in f["fix"] for f in errors), errors
    assert all("input_norm.weight" in f["message"] and "vLLM" in f["message"] for f in errors)
    assert main(["doctor", str(folder)]) == 1
    assert "norm_before_fc" in capsys.readouterr().out
    with pytest.raises(UserError, match=f"norm_before_fc.*{fix}"):  # convert's loader
        convert(folder, tmp_path / "out", "speculators", repair=True, log=lambda _: None)


def test_norm_before_fc_drafts_are_clean_where_it_is_honoured(tmp_path, target_dir):
    ckpt = make_ckpt(aux_layer_ids=AUX, max_position_embeddings=512, norm_before_residual=True,
                     norm_before_fc=True)  # fmt: skip
    for layout in LAYOUTS:
        save_checkpoint(ckpt, tmp_path / layout, layout)
        report = doctor(tmp_path / layout, str(target_dir), ["vllm", "llama.cpp", "sglang"], False)
        [nbf] = [f for f in report["findings"] if f["check"] == "norm_before_fc"]
        assert nbf["level"] == "ok" and "with input_norm.weight" in nbf["message"]
        errors = {(f["check"], f["engine"], f["field"]) for f in findings(report)}
        sglang = {("options", "sglang", "norm_before_residual"),
                  ("options", "sglang", "norm_before_fc")}  # fmt: skip
        assert errors == (sglang if layout == "eagle" else {("layout", "sglang", "format")})


def test_norm_before_fc_where_tensorrt_llm_misses_it_is_repaired(tmp_path):
    """An eagle config with the flag top-level only: vLLM and llama.cpp's converter read it,
    TensorRT-LLM (eagle_config only) does not; --repair writes both places."""
    ckpt = make_ckpt(aux_layer_ids=AUX, max_position_embeddings=512, norm_before_residual=True,
                     norm_before_fc=True)  # fmt: skip
    folder = tmp_path / "e"
    save_checkpoint(ckpt, folder, "eagle")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"]["norm_before_fc"]
    (folder / "config.json").write_text(json.dumps(cfg))
    [error] = [f for f in findings(doctor(folder)) if f["check"] == "norm_before_fc"]
    assert error["field"] == "eagle_config.norm_before_fc" and "TensorRT-LLM" in error["message"]
    with pytest.raises(UserError, match="--repair fixes the marked ones"):
        convert(folder, tmp_path / "out", "eagle", log=lambda _: None)
    lines = []
    out = convert(folder, tmp_path / "out", "eagle", repair=True, log=lines.append)
    assert any("repaired eagle_config.norm_before_fc" in line for line in lines), lines
    assert json.loads((out / "config.json").read_text())["eagle_config"]["norm_before_fc"] is True
    assert doctor(out)["ok"]


# -- convert never launders ------------------------------------------------------------

REPAIRABLE = ("tie_word_embeddings", "architectures", "dtype", "norm_before_residual removed")
UNREPAIRABLE = ("aux ids shifted by one", "aux spellings disagree")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", sorted(CONFIG_FAULTS))
def test_convert_refuses_each_laundering_case(clean, tmp_path, layout, fault):
    edit, field = CONFIG_FAULTS[fault]
    folder = seeded(clean, tmp_path, layout, config=edit)
    other = "speculators" if layout == "eagle" else "eagle"
    with pytest.raises(UserError, match="refusing to write a clean config") as err:
        convert(folder, tmp_path / "out", other, log=lambda _: None)
    assert field in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", REPAIRABLE)
def test_convert_repair_fixes_and_says_what(clean, tmp_path, layout, fault):
    edit, field = CONFIG_FAULTS[fault]
    folder = seeded(clean, tmp_path, layout, config=edit)
    lines = []
    out = convert(folder, tmp_path / "out", layout, repair=True, log=lines.append)
    assert any("repaired" in line and field in line for line in lines), lines
    report = doctor(out)
    assert report["ok"], findings(report)
    assert json.loads((out / "config.json").read_text())["norm_before_residual"] is True


@pytest.mark.parametrize("fault", ["rope_theta alone", "rope_scaling alone"])
def test_rope_is_repaired_only_from_the_target(clean, tmp_path, target_dir, fault):
    folder = seeded(clean, tmp_path, "eagle", config=CONFIG_FAULTS[fault][0])
    with pytest.raises(UserError, match="--target --repair"):
        convert(folder, tmp_path / "out", "speculators", repair=True, log=lambda _: None)
    out = convert(folder, tmp_path / "out", "speculators", target=str(target_dir), repair=True,
                  log=lambda _: None)  # fmt: skip
    assert doctor(out)["ok"]


@pytest.mark.parametrize("fault", UNREPAIRABLE)
def test_ambiguous_faults_are_refused_even_with_repair(clean, tmp_path, fault):
    folder = seeded(clean, tmp_path, "eagle", config=CONFIG_FAULTS[fault][0])
    with pytest.raises(UserError, match="aux_hidden_state_layer_ids|aux_layer_ids"):
        convert(folder, tmp_path / "out", "speculators", repair=True, log=lambda _: None)


def test_a_nan_weight_is_refused_by_convert(clean, tmp_path):
    folder = seeded(clean, tmp_path, "eagle", tensors=nan_weight("eagle"))
    assert main(["convert", str(folder), str(tmp_path / "out"), "--to", "speculators",
                 "--repair"]) == 2  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_convert_carries_the_record_into_both_layouts(clean, tmp_path):
    record = find_record(clean / "eagle")
    out = convert(clean / "eagle", tmp_path / "spec", "speculators", log=lambda _: None)
    assert find_record(out) == record
    back = convert(out, tmp_path / "eagle", "eagle", log=lambda _: None)
    assert find_record(back) == record


# -- the numeric check -----------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target folder, run folder): a tiny draft trained by the trainer on a peaked tiny
    target's own greedy replies; its final/ and metrics.json (the record doctor reads)."""
    import datasets

    from eagletools.targets import Target, TargetInfo
    from eagletools.train.inputs import online_inputs
    from eagletools.train.recipe import load_config
    from eagletools.train.trainer import Trainer

    root = tmp_path_factory.mktemp("trained")
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # a peaked target: something a few steps can learn
    target_dir = save_target_folder(root / "target", model)
    prompts = torch.randint(0, 256, (48, 6), generator=torch.Generator().manual_seed(0))
    replies = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=32, min_new_tokens=32)  # fmt: skip
    rows = {"input_ids": replies.tolist(), "loss_mask": [[0] * 6 + [1] * 32] * len(replies)}
    config = load_config(None, [
        "training.precision=fp32", "training.batch_size=8", "training.max_steps=60",
        "training.lr=3e-3", "training.warmup_ratio=0", "training.ttt_steps=3",
        "training.eval_ttt_steps=3", "training.eval_every=0", "training.save_every=0",
        "data.eval_samples=12", "vocab.draft_vocab_size=128",
    ])  # fmt: skip
    target = Target(model, None, TargetInfo.from_config(model.config, "tiny"))
    inputs = online_inputs(config, target, datasets.Dataset.from_dict(rows))
    Trainer(config, root / "run", inputs).run()
    return target_dir, root / "run"


def test_a_trained_draft_meets_its_record(trained, capsys):
    target_dir, run = trained
    report = doctor(run / "final", str(target_dir))
    assert report["ok"] and report["record"], findings(report)
    [numeric] = [f for f in report["findings"] if f["check"] == "numeric"]
    assert numeric["level"] == "ok" and "recorded in training" in numeric["message"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fault", [swap_k_v, transpose_o], ids=["k_v_swapped", "o_transposed"])
def test_weights_that_keep_their_shapes_are_caught_numerically(trained, tmp_path, layout, fault):
    target_dir, run = trained
    convert(
        run / "final", tmp_path / "clean" / layout, layout, log=lambda _: None
    )  # the record too
    folder = seeded(tmp_path / "clean", tmp_path, layout, tensors=fault)
    report = doctor(folder, str(target_dir))
    [error] = findings(report)
    assert error["check"] == "numeric" and "far below" in error["message"]
    assert "k_proj/v_proj swapped" in error["message"]


# -- GGUF: the static checks that apply to one file -------------------------------------


def test_gguf_faults_are_caught_in_the_file(case, tmp_path):  # noqa: F811 (the fixture)
    """A NaN in a GGUF tensor and d2t left as offsets (llama.cpp reads absolute ids)."""
    import numpy as np
    from gguf import GGUFReader

    path = tmp_path / "draft.gguf"
    args = ["convert", str(case / "eagle"), str(path), "--to", "gguf", "--target"]
    assert main([*args, str(case / "target")]) == 0
    report = doctor(path)
    assert report["ok"] and not findings(report, "warn"), findings(report)
    tensors = {t.name: t for t in GGUFReader(path, "r+").tensors}
    tensors["blk.0.attn_norm.weight"].data[0] = np.nan
    d2t = tensors["d2t"].data
    d2t[:] = d2t - np.arange(len(d2t))  # offsets, as the folder layouts hold them
    del tensors
    report = doctor(path)
    assert {f["field"] for f in findings(report)} == {"blk.0.attn_norm.weight", "d2t"}


def test_json_for_ci_and_every_engine(clean, target_dir, tmp_path, capsys):
    """`--engine all --json`: one object, a finding per engine; the numeric check is
    skipped, not crashed, on a draft the target cannot run (another vocabulary)."""
    capsys.readouterr()
    rc = main(["doctor", str(clean / "eagle"), "--engine", "all", "--json"])
    report = json.loads(capsys.readouterr().out)
    engines = {f["engine"] for f in report["findings"]} - {None}
    assert engines == {"vllm", "sglang", "sgl-jax", "llama.cpp", "tensorrt-llm", "eagle"}
    assert rc == 1 and {f["engine"] for f in findings(report)} == engines - {"vllm", "llama.cpp"}
    save_checkpoint(make_ckpt(vocab_size=300), tmp_path / "other", "eagle")
    report = doctor(tmp_path / "other", str(target_dir))
    assert [f["field"] for f in findings(report)] == ["vocab_size"]
    [numeric] = [f for f in report["findings"] if f["check"] == "numeric"]
    assert numeric["level"] == "info" and "not run" in numeric["message"]
