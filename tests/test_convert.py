"""`eagletools convert`: real-shaped inputs convert cleanly; bad input writes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from test_formats import (
    eagle_release_tensors,
    make_ckpt,
    safeailab_release,
    save_raw,
    save_target_folder,
    specforge_export,
)

from eagletools.cli import main
from eagletools.formats import load_checkpoint, save_checkpoint

LONG_ROPE_TARGET = dict(
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, max_position_embeddings=4096
)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A 6-layer Llama target the tiny drafts fit, with RoPE and positions unlike theirs."""
    folder = tmp_path_factory.mktemp("target")
    return save_target_folder(folder, tiny_model("llama", num_hidden_layers=6, **LONG_ROPE_TARGET))


def read_config(folder):
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_safeailab_release_to_speculators_with_target(tmp_path, target_dir, pickle, capsys):
    src = safeailab_release(tmp_path / "release", pickle=pickle)
    out = tmp_path / "out"
    args = ["convert", str(src), str(out), "--to", "speculators", "--target", str(target_dir)]
    assert main(args + (["--allow-pickle"] if pickle else [])) == 0
    cfg = read_config(out)
    layer = cfg["transformer_layer_config"]
    assert layer["max_position_embeddings"] == 4096  # from the target, not the release's 2048
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # target default [2, N//2, N-3]
    assert cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["verifier"] == {
        "name_or_path": str(target_dir.resolve()),
        "architectures": ["LlamaForCausalLM"],
    }
    assert "max_position_embeddings 2048 -> 4096" in capsys.readouterr().out
    src_tensors = eagle_release_tensors(torch.float16, False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(k.replace("midlayer.", "layers.0.") for k in src_tensors)
        for k, v in src_tensors.items():
            assert torch.equal(f.get_tensor(k.replace("midlayer.", "layers.0.")), v), k
    assert main(["inspect", str(out), "--target", str(target_dir)]) == 0


def test_specforge_export_to_speculators_keeps_bf16_and_aux_ids(tmp_path):
    src = specforge_export(tmp_path / "sf", num_target_layers=32)
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "speculators",
                 "--with-embeddings"]) == 0  # fmt: skip
    cfg = read_config(tmp_path / "out")
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert cfg["dtype"] == "bfloat16"
    back = load_checkpoint(tmp_path / "out")
    for k, v in eagle_release_tensors(torch.bfloat16, True).items():
        assert torch.equal(back.tensors[k], v), k
    assert main(["inspect", str(tmp_path / "out")]) == 0


def test_dtype_cast_and_back_to_eagle(tmp_path):
    src = specforge_export(tmp_path / "sf")
    assert main(["convert", str(src), str(tmp_path / "s"), "--to", "speculators",
                 "--dtype", "fp16"]) == 0  # fmt: skip
    assert main(["convert", str(tmp_path / "s"), str(tmp_path / "e"), "--to", "eagle"]) == 0
    back = load_checkpoint(tmp_path / "e")
    assert back.tensors["fc.weight"].dtype == torch.float16
    assert back.tensors["d2t"].dtype == torch.int64 and back.tensors["t2d"].dtype == torch.bool
    assert read_config(tmp_path / "e")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        1,
        0,
    ]


def test_force_is_needed_to_replace(tmp_path, capsys):
    src = specforge_export(tmp_path / "sf")
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--to", "eagle"]) == 0
    assert main(["convert", str(src), str(out), "--to", "speculators"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert "speculators_model_type" not in read_config(out)
    assert main(["convert", str(src), str(out), "--to", "speculators", "--force"]) == 0
    assert "speculators_model_type" in read_config(out)


def _truncated(tmp_path):
    folder = specforge_export(tmp_path / "src")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-1000])
    return folder


def _edited(tmp_path, edit):
    cfg = read_config(safeailab_release(tmp_path / "ref"))
    tensors = eagle_release_tensors(torch.float16, False)
    edit(tensors)
    return save_raw(tmp_path / "src", cfg, tensors)


BAD_INPUTS = {
    "truncated": (_truncated, r"model.safetensors: unreadable safetensors file"),
    "missing-key": (
        lambda p: _edited(p, lambda t: t.pop("midlayer.mlp.up_proj.weight")),
        r"missing tensor(s) ['midlayer.mlp.up_proj.weight']",
    ),
    "wrong-shape": (
        lambda p: _edited(p, lambda t: t.update({"fc.weight": torch.zeros(64, 128).half()})),
        r"tensor 'fc.weight' has shape [64, 128], expected [64, 192]",
    ),
    "d2t-out-of-range": (
        lambda p: _edited(p, lambda t: t["d2t"].__setitem__(-1, 1000)),
        "target ids i + d2t[i] lie in [0, V)",
    ),
    "d2t-decreasing": (
        lambda p: _edited(p, lambda t: t["d2t"].__setitem__(0, 50)),
        "d2t is non-decreasing",
    ),
    "t2d-count": (
        lambda p: _edited(p, lambda t: t["t2d"].__setitem__(t["t2d"].nonzero()[0], False)),
        "t2d.sum() == Vd (t2d.sum()=99)",
    ),
    "unknown-format": (
        lambda p: save_raw(p / "src", {"architectures": ["BertModel"]}, {"x": torch.zeros(1)}),
        "unknown checkpoint format (architectures=['BertModel']",
    ),
    "pickle": (
        lambda p: safeailab_release(p / "src", pickle=True),
        "pytorch_model.bin: a pickle file, which can run code when loaded; pass --allow-pickle",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_named_and_nothing_is_written(tmp_path, case, capsys):
    build, message = BAD_INPUTS[case]
    src = build(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "speculators"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp folder


def test_target_hidden_size_mismatch_is_refused(tmp_path, capsys):
    narrow = save_target_folder(tmp_path / "narrow", tiny_model("llama", hidden_size=32))
    src = specforge_export(tmp_path / "sf")
    args = ["convert", str(src), str(tmp_path / "out"), "--to", "speculators", "--target"]
    assert main(args + [str(narrow)]) == 2
    err = capsys.readouterr().err
    assert "target_hidden_size: the draft fuses aux states of width 64" in err
    assert "hidden_size 32" in err
    assert not (tmp_path / "out").exists()


def test_with_embeddings_comes_from_the_target(tmp_path, target_dir):
    src = safeailab_release(tmp_path / "release")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "eagle", "--with-embeddings",
                 "--target", str(target_dir)]) == 0  # fmt: skip
    embed = load_checkpoint(tmp_path / "out").tensors["embed_tokens.weight"]
    from transformers import AutoModelForCausalLM

    expected = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight
    assert embed.dtype == torch.float16
    assert torch.equal(embed, expected.detach().half())
    # without a target there is nothing to take them from
    assert main(["convert", str(src), str(tmp_path / "o2"), "--to", "eagle",
                 "--with-embeddings"]) == 2  # fmt: skip


def test_training_checkpoint_converts(tmp_path):
    ckpt = make_ckpt(aux_layer_ids=[1, 2, 3])
    ckpt.tensors.pop("embed_tokens.weight")
    save_checkpoint(ckpt, tmp_path / "run/checkpoints/step-00000100", "training")
    src = tmp_path / "run/checkpoints/step-00000100"
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "eagle"]) == 0
    assert read_config(tmp_path / "out")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        0,
        1,
        2,
    ]


def write_big_target(folder, intermediate_size: int = 700_000) -> int:
    """A 4-layer Llama target folder whose MLPs make model.safetensors ~1 GB (bf16);
    returns the weight bytes.

    The file is written sparse (a header, then a hole of zeros), so it costs
    no disk and no time; only what a reader touches becomes memory.
    """
    from types import SimpleNamespace

    from conftest import tiny_config
    from test_formats import save_target_folder as save_with_tokenizer
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", intermediate_size=intermediate_size)
    with torch.device("meta"):
        shapes = {
            k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        end = offset + shape.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    folder.mkdir(parents=True)
    save_with_tokenizer(
        folder, SimpleNamespace(config=config, save_pretrained=config.save_pretrained)
    )
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def test_convert_against_a_1gb_target_reads_only_config_and_embeddings(tmp_path):
    """Converting a draft for an 8B target must not load the 8B target (in fp32 it was 2x)."""
    import subprocess
    import sys

    target = tmp_path / "big-target"
    weight_bytes = write_big_target(target)
    assert weight_bytes > 1e9
    ckpt = make_ckpt(aux_layer_ids=None)
    ckpt.tensors.pop("embed_tokens.weight")
    save_checkpoint(ckpt, tmp_path / "draft", "eagle")
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking pytest process
    code = (
        "import re, sys\n"
        "from eagletools.cli import main\n"
        "rc = main(sys.argv[1:])\n"
        "status = open('/proc/self/status').read()\n"
        "print('peak_kb', re.search(r'VmHWM:\\s+(\\d+)', status).group(1))\n"
        "sys.exit(rc)\n"
    )
    args = [str(tmp_path / "draft"), str(tmp_path / "out"), "--to", "speculators",
            "--target", str(target), "--with-embeddings"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", code, "convert", *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    peak_mb = int(run.stdout.split("peak_kb")[-1]) / 1024
    assert peak_mb < 400, f"peak RSS {peak_mb:.0f} MB"
    out = load_checkpoint(tmp_path / "out")
    assert out.config.aux_layer_ids == [2, 2, 1]  # the default for 4 layers, from the config
    assert out.tensors["embed_tokens.weight"].shape == (256, 64)
    (target / "model.safetensors").unlink()
