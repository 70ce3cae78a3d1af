"""`convert --to gguf`: the file llama.cpp 11434's own converter writes for the same draft.

The pinned fixture (tests/data/gguf_llamacpp_11434.json) is the snapshot of
`convert_hf_to_gguf.py --target-model-dir --outtype bf16` on the tiny case
below; the live test reruns that converter when `make engine-llamacpp` has
unpacked it, so the fixture cannot rot. Left out of every comparison:
`general.name` (each tool names the file its own way) and `general.size_label`
(llama.cpp's naming guess from the parameter count; the loader ignores both).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_formats import make_ckpt

from eagletools.cli import main
from eagletools.errors import UserError
from eagletools.formats import detect_format, save_checkpoint, sniff_format

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
LLAMACPP = ROOT / ".engines" / "llama.cpp-11434.0.0"
FIXTURE = Path(__file__).parent / "data" / "gguf_llamacpp_11434.json"
EXCLUDED = {"general.name", "general.size_label"}
VOCAB = 320
TARGET_LAYERS = 6
AUX_IDS = {"eagle": [2, 3, 3], "speculators": [1, 4, 5]}  # eagle: the target default (see docs)
# the speculators draft takes the residual after hidden_norm, as speculators trains (and the long
# recipe); llama.cpp's converter reads the flag from its config
NORM_BEFORE_RESIDUAL = {"eagle": False, "speculators": True}


def byte_fallback_tokenizer():
    """A Llama-2-style BPE (byte fallback, `▁` spaces) covering exactly VOCAB ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    letters = "abcdefgh"
    pieces = ["▁", *letters] + [f"▁{c}" for c in letters] + [a + b for a in letters for b in "ab"]
    merges = [("▁", c) for c in letters] + [(a, b) for a in letters for b in "ab"]
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Path:
    """A tiny target folder and one bf16 draft for it in each layout our convert writes."""
    root = tmp_path_factory.mktemp("gguf")
    target = tiny_model(
        "llama", num_hidden_layers=TARGET_LAYERS, vocab_size=VOCAB, max_position_embeddings=2048
    )
    target.save_pretrained(root / "target")
    byte_fallback_tokenizer().save_pretrained(root / "target")
    for layout, ids in AUX_IDS.items():
        ckpt = make_ckpt(
            vocab_size=VOCAB, aux_layer_ids=ids, norm_before_residual=NORM_BEFORE_RESIDUAL[layout]
        )
        save_checkpoint(ckpt, root / layout, layout, dtype="bf16")
    return root


def ours(case: Path, layout: str) -> Path:
    out = case / f"ours-{layout}.gguf"
    if not out.exists():
        args = ["convert", str(case / layout), str(out), "--to", "gguf"]
        assert main([*args, "--target", str(case / "target")]) == 0
    return out


def snapshot(path: Path) -> dict:
    """Tensor names, types, shapes and every metadata value (long arrays by digest)."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in EXCLUDED:
            continue
        value = field.contents()
        if isinstance(value, list) and len(value) > 16:
            value = {"len": len(value), "sha256": hashlib.sha256(repr(value).encode()).hexdigest()}
        types = [t.name for t in field.types]
        meta[field.name] = {"types": types, "value": value}
    tensors = {
        t.name: {"type": t.tensor_type.name, "shape": [int(n) for n in t.shape]}
        for t in reader.tensors
    }
    return {"metadata": meta, "tensors": tensors}


def tensor_bytes(path: Path) -> dict[str, bytes]:
    return {t.name: t.data.tobytes() for t in gguf.GGUFReader(path).tensors}


def test_matches_llamacpp_11434_pinned(case):
    expected = json.loads(FIXTURE.read_text())
    assert snapshot(ours(case, "eagle")) == {k: expected[k] for k in ("metadata", "tensors")}


def llamacpp_convert(case: Path, layout: str) -> Path:
    out = case / f"llamacpp-{layout}.gguf"
    if out.exists():
        return out
    env = dict(os.environ, PYTHONPATH=str(LLAMACPP / "gguf-py"))
    cmd = [
        sys.executable, str(LLAMACPP / "convert_hf_to_gguf.py"), str(case / layout),
        "--target-model-dir", str(case / "target"), "--outtype", "bf16", "--outfile", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.parametrize("layout", sorted(AUX_IDS))
def test_matches_llamacpp_converter_live(case, layout):
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp 11434 source not unpacked: make engine-llamacpp")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports it")
    theirs, mine = llamacpp_convert(case, layout), ours(case, layout)
    assert snapshot(mine) == snapshot(theirs)
    assert tensor_bytes(mine) == tensor_bytes(theirs)  # bitwise: bf16, f32 and the i64 d2t
    fields = gguf.GGUFReader(mine).fields
    # HF ids, as trained (the eagle file holds ids - 1)
    assert fields["eagle3.target_layers"].contents() == AUX_IDS[layout]
    assert fields["eagle3.norm_before_residual"].contents() is NORM_BEFORE_RESIDUAL[layout]


def test_pinned_fixture_is_llamacpps_output(case):
    """When the converter is here, the fixture is exactly its snapshot.

    EAGLETOOLS_UPDATE_GGUF_FIXTURE=1 rewrites it (only when the pinned llama.cpp changes).
    """
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp 11434 source not unpacked: make engine-llamacpp")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports it")
    theirs = snapshot(llamacpp_convert(case, "eagle"))
    if os.environ.get("EAGLETOOLS_UPDATE_GGUF_FIXTURE") == "1":
        made = {
            "made_by": "llama.cpp 11434 convert_hf_to_gguf.py --outtype bf16 (tests/test_gguf.py)"
        }
        FIXTURE.write_text(json.dumps(made | theirs, indent=1, sort_keys=True) + "\n")
    expected = json.loads(FIXTURE.read_text())
    assert theirs == {k: expected[k] for k in ("metadata", "tensors")}


def test_needs_target(case, capsys):
    assert main(["convert", str(case / "eagle"), str(case / "x.gguf"), "--to", "gguf"]) == 2
    assert (
        "needs --target: the GGUF draft carries the target's tokenizer" in capsys.readouterr().err
    )
    assert not (case / "x.gguf").exists()


def test_target_without_tokenizer(case, tmp_path, capsys):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((case / "target" / "config.json").read_text())
    args = ["convert", str(case / "eagle"), str(tmp_path / "x.gguf"), "--to", "gguf"]
    assert main([*args, "--target", str(tmp_path / "bare")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bare'}: no tokenizer.json" in err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("option", ["fc_norm", "norm_output"])
def test_eagle31_options_are_refused(case, tmp_path, option, capsys):
    save_checkpoint(make_ckpt(vocab_size=VOCAB, **{option: True}), tmp_path / "d", "speculators")
    args = ["convert", str(tmp_path / "d"), str(tmp_path / "x.gguf"), "--to", "gguf"]
    assert main([*args, "--target", str(case / "target")]) == 2
    err = capsys.readouterr().err
    assert option in err and "--to speculators (vLLM)" in err
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("layout", sorted(AUX_IDS))
def test_norm_before_fc_as_llamacpps_converter_writes_it(case, tmp_path, layout):
    """llama.cpp 11434 honours norm_before_fc: key `eagle3.norm_before_fc`, the norm as
    `enc.output_norm` [3*Ht] (src/models/eagle3.cpp:33, 61-63, 131-133), which its
    converter takes from `input_norm.weight` and a top-level `norm_before_fc`
    (conversion/llama.py:102, 238); live against that converter when unpacked."""
    from safetensors.torch import load_file

    src = tmp_path / layout
    ckpt = make_ckpt(vocab_size=VOCAB, aux_layer_ids=AUX_IDS[layout], norm_before_fc=True,
                     norm_before_residual=NORM_BEFORE_RESIDUAL[layout])  # fmt: skip
    save_checkpoint(ckpt, src, layout, dtype="bf16")
    mine = tmp_path / "ours.gguf"
    assert main(["convert", str(src), str(mine), "--to", "gguf", "--target", str(case / "target")]) == 0  # fmt: skip
    reader = gguf.GGUFReader(mine)
    assert reader.fields["eagle3.norm_before_fc"].contents() is True
    norm = next(t for t in reader.tensors if t.name == "enc.output_norm.weight")
    assert norm.tensor_type.name == "F32" and [int(n) for n in norm.shape] == [3 * 64]
    stored = load_file(src / "model.safetensors")["input_norm.weight"].float()
    assert torch.equal(torch.from_numpy(norm.data.copy()), stored)
    if not (LLAMACPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp 11434 source not unpacked: make engine-llamacpp")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter imports it")
    theirs = tmp_path / "theirs.gguf"
    env = dict(os.environ, PYTHONPATH=str(LLAMACPP / "gguf-py"))
    cmd = [
        sys.executable, str(LLAMACPP / "convert_hf_to_gguf.py"), str(src),
        "--target-model-dir", str(case / "target"), "--outtype", "bf16", "--outfile", str(theirs),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert snapshot(mine) == snapshot(theirs)
    assert tensor_bytes(mine) == tensor_bytes(theirs)


def test_qk_permutation_is_ggml_pair_layout(case):
    """Row 2i/2i+1 of each GGUF q head are rows i/i+hd/2 of the HF head (GGML's normal RoPE)."""
    from safetensors.torch import load_file

    src = load_file(case / "eagle" / "model.safetensors")["midlayer.self_attn.q_proj.weight"]
    q = next(
        t for t in gguf.GGUFReader(ours(case, "eagle")).tensors if t.name == "blk.0.attn_q.weight"
    )
    got = torch.from_numpy(q.data.copy()).view(torch.bfloat16).reshape(src.shape)
    hd = 16
    assert torch.equal(got[0], src[0]) and torch.equal(got[1], src[hd // 2])
    assert torch.equal(got[hd + 2], src[hd + 1]) and torch.equal(got[hd + 3], src[hd + 1 + hd // 2])


def test_embeddings_come_from_the_target_file_alone(case, tmp_path, monkeypatch):
    """--with-embeddings reads the target's embedding tensor, never its whole model:
    a 70B target would otherwise be loaded to copy one matrix."""
    import eagletools.targets

    def refuse(*args, **kwargs):
        raise AssertionError("load_target called: the whole target was loaded")

    monkeypatch.setattr(eagletools.targets, "load_target", refuse)
    out = tmp_path / "x.gguf"
    args = ["convert", str(case / "eagle"), str(out), "--to", "gguf", "--with-embeddings"]
    assert main([*args, "--target", str(case / "target")]) == 0
    embed = next(t for t in gguf.GGUFReader(out).tensors if t.name == "token_embd.weight")
    assert [int(n) for n in embed.shape] == [64, VOCAB]


# sha256 of the whole file as the writer produced it before GGUF joined the format registry;
# any change to these bytes must be deliberate (llama.cpp reads them)
WRITTEN_SHA256 = {
    "eagle": "07f202c194761f22467e09993612bdd165369ea27a48c98d892c9b97707863d6",
    "speculators": "3db5187242f1bf281f3173ccdd9b3a360291e1fd30ad58c96659c621f9a4970a",
    "fp32-as-bf16-with-embeddings": "29ba0dfd9de46f513f6e3179443981c45f894b1badb536fa22065ce6cc030f0f",
}


def written(case: Path, name: str) -> Path:
    if name in AUX_IDS:
        return ours(case, name)
    src, out = case / "fp32", case / f"ours-{name}.gguf"
    if not src.exists():  # fp32 norms must stay exactly F32 under --dtype bf16
        save_checkpoint(make_ckpt(vocab_size=VOCAB, aux_layer_ids=[1, 3, 5]), src, "eagle")
    args = ["convert", str(src), str(out), "--to", "gguf", "--dtype", "bf16", "--with-embeddings"]
    assert main([*args, "--target", str(case / "target")]) == 0
    return out


@pytest.mark.parametrize("name", sorted(WRITTEN_SHA256))
def test_written_bytes_are_pinned(case, name):
    data = written(case, name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == WRITTEN_SHA256[name]


def test_detected_by_content_not_suffix(case, tmp_path):
    """`sniff_format` reads the GGUF magic: any name is a GGUF draft, a `.gguf` name alone is not."""
    renamed = tmp_path / "draft.bin"
    renamed.write_bytes(ours(case, "eagle").read_bytes())
    (tmp_path / "fake.gguf").write_text("not a gguf")
    assert sniff_format(renamed) == "gguf"
    assert sniff_format(tmp_path / "fake.gguf") is None
    assert sniff_format(case / "eagle") == "eagle"
    with pytest.raises(UserError, match="a file, and not a GGUF draft; give the checkpoint folder"):
        detect_format(tmp_path / "fake.gguf")


def test_reading_a_gguf_draft_names_the_file_and_the_fix(case, capsys):
    """GGUF is write-only: convert and inspect refuse it and point at the source folder."""
    path = ours(case, "eagle")
    assert main(["convert", str(path), str(case / "back"), "--to", "eagle"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: a gguf draft, which eagletools writes but does not read" in err
    assert "give the checkpoint it was converted from" in err
    assert not (case / "back").exists()
