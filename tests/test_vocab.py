"""Draft vocabulary (docs/design.md 3.2): selection, invariants, files, CLI, recount."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagletools.cli import main
from eagletools.errors import UserError
from eagletools.vocab import DraftVocab, build_vocab, select_top


def recount(rows, vocab_size: int, size: int) -> tuple[list[int], float]:
    """The rule of docs/design.md 3.2 written the plain way: (selected ids, coverage)."""
    counts = Counter()
    for row in rows:
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    unused = (t for t in range(vocab_size) if t not in counts)
    while len(ranked) < size:
        ranked.append(next(unused))
    total = sum(counts.values())
    return sorted(ranked), sum(counts[t] for t in ranked) / total


def rows_from(seqs):
    return [{"input_ids": ids, "loss_mask": mask} for ids, mask in seqs]


class Rows(list):
    """The two things build_vocab uses of a datasets.Dataset: len and iter(batch_size)."""

    def iter(self, batch_size):
        for i in range(0, len(self), batch_size):
            chunk = self[i : i + batch_size]
            yield {k: [r[k] for r in chunk] for k in ("input_ids", "loss_mask")}


def test_selection_ties_padding_and_masking():
    rows = Rows(rows_from([
        ([5, 7, 7, 3, 9, 9], [0, 1, 1, 1, 1, 1]),  # 5 is not a reply token
        ([9, 3, 1, 5], [1, 1, 0, 0]),
    ]))  # fmt: skip
    # counts: 9:3, 3:2, 7:2 (tie with 3 -> smaller id first), then padding 0, 1, 2
    vocab, report = build_vocab(rows, 12, 6)
    assert vocab.selected.tolist() == [0, 1, 2, 3, 7, 9]
    assert vocab.d2t.tolist() == [0, 0, 0, 0, 3, 4]
    assert report == {
        "coverage": 1.0, "draft_vocab_size": 6, "target_vocab_size": 12,
        "distinct_tokens": 3, "num_samples": 2, "num_tokens": 7,
    }  # fmt: skip
    vocab, report = build_vocab(rows, 12, 2)
    assert vocab.selected.tolist() == [3, 9] and report["coverage"] == pytest.approx(5 / 7)
    assert (vocab.selected.tolist(), report["coverage"]) == recount(rows, 12, 2)


def test_random_counts_equal_the_recount():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(40):
        n = int(torch.randint(1, 60, (1,), generator=g))
        ids = (torch.rand(n, generator=g) ** 3 * 300).long().tolist()  # skewed, many ties
        seqs.append((ids, torch.randint(0, 2, (n,), generator=g).tolist()))
    rows = Rows(rows_from(seqs))
    for size in (1, 17, 64, 299, 300):
        vocab, report = build_vocab(rows, 300, size)
        selected, coverage = recount(rows, 300, size)
        assert vocab.selected.tolist() == selected
        assert report["coverage"] == pytest.approx(coverage)
        vocab.validate()


def test_select_top_is_stable_for_ties():
    counts = torch.tensor([0, 2, 5, 2, 0, 5, 1])
    assert select_top(counts, 4).tolist() == [1, 2, 3, 5]
    assert select_top(counts, 6).tolist() == [0, 1, 2, 3, 5, 6]


def test_constructors_and_invariants():
    vocab = DraftVocab.from_selected([9, 2, 4, 2], 10)
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    assert vocab.d2t.tolist() == [2, 3, 7]
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 4, 9]
    assert vocab.to_target(torch.tensor([[2, 0], [1, 1]])).tolist() == [[9, 2], [4, 4]]
    assert all(ok for _, ok, _ in vocab.checks())
    again = DraftVocab.from_d2t(vocab.d2t, 10)
    assert torch.equal(again.t2d, vocab.t2d)
    ident = DraftVocab.identity(6)
    assert ident.is_identity and ident.d2t.tolist() == [0] * 6 and bool(ident.t2d.all())
    assert torch.equal(DraftVocab.from_d2t(torch.zeros(6, dtype=torch.long), 6).t2d, ident.t2d)
    with pytest.raises(UserError, match=r"\[0, 10\)"):
        DraftVocab.from_selected([3, 10], 10)


@pytest.mark.parametrize(
    ("d2t", "t2d", "failed"),
    [
        ([0, 2, 1], [1, 0, 1, 1, 0], "d2t is non-decreasing"),  # ids 0, 3, 3
        ([0, 1, 4], [1, 0, 1, 0, 0], "target ids"),  # id 6 >= V
        ([0, 1, 1], [1, 0, 1, 1, 1], "t2d.sum() == Vd"),
        ([0, 1, 1], [1, 1, 0, 1, 0], "nonzero(t2d)"),
        ([], [0, 0], "1 <= Vd <= V"),
    ],
)
def test_each_invariant_can_fail(d2t, t2d, failed):
    vocab = DraftVocab(torch.tensor(d2t, dtype=torch.long), torch.tensor(t2d, dtype=torch.bool))
    assert [name for name, ok, _ in vocab.checks() if not ok][0].startswith(failed)
    with pytest.raises(UserError, match=f"my.safetensors: invalid d2t/t2d: .*{re.escape(failed)}"):
        vocab.validate("my.safetensors")


def test_save_load_and_bad_files(tmp_path):
    vocab = DraftVocab.from_selected([1, 3, 4], 8)
    vocab.save(tmp_path / "v.safetensors")
    loaded = DraftVocab.load(tmp_path / "v.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    with pytest.raises(UserError, match="no such file"):
        DraftVocab.load(tmp_path / "missing.safetensors")
    save_file({"d2t": vocab.d2t}, str(tmp_path / "only_d2t.safetensors"))
    with pytest.raises(UserError, match=r"missing tensor\(s\) \['t2d'\]"):
        DraftVocab.load(tmp_path / "only_d2t.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a safetensors file"):
        DraftVocab.load(tmp_path / "junk.safetensors")


def test_inspect_prints_every_invariant(tmp_path, capsys):
    DraftVocab.from_selected([0, 5], 6).save(tmp_path / "good.safetensors")
    assert main(["vocab", "inspect", str(tmp_path / "good.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "Vd=2 V=6" in out and out.count("ok  ") == 7
    bad = {"d2t": torch.tensor([0, 5]), "t2d": torch.tensor([1, 0, 0, 0, 0, 1], dtype=torch.bool)}
    save_file(bad, str(tmp_path / "bad.safetensors"))  # id 1 + 5 = 6 is outside V
    assert main(["vocab", "inspect", str(tmp_path / "bad.safetensors")]) == 1
    assert "FAIL target ids i + d2t[i] lie in [0, V)" in capsys.readouterr().out


@pytest.fixture
def tiny_target(tmp_path, monkeypatch):
    from test_data import SHAREGPT, ULTRACHAT, _save_tiny_target, write_jsonl

    monkeypatch.setenv("EAGLETOOLS_CACHE", str(tmp_path / "cache"))
    _save_tiny_target(tmp_path / "target")
    write_jsonl(tmp_path / "d.jsonl", [SHAREGPT, ULTRACHAT, {"messages": []}] * 4)
    return tmp_path


def build_argv(root, out, size, *extra):
    return [
        "vocab", "build", "--target", str(root / "target"), "--data", str(root / "d.jsonl"),
        "--size", str(size), "--output-dir", str(out), "--max-length", "256", *extra,
    ]  # fmt: skip


def test_cli_build_is_deterministic_and_cached(tiny_target, monkeypatch, capsys):
    root = tiny_target
    assert main(build_argv(root, root / "a", 64)) == 0
    report = json.loads((root / "a" / "report.json").read_text())
    assert report["num_samples"] == 8 and report["draft_vocab_size"] == 64
    assert report["target_vocab_size"] == 400 and 0 < report["coverage"] <= 1
    monkeypatch.setenv("EAGLETOOLS_CACHE", str(root / "cache2"))  # rebuild from scratch
    assert main(build_argv(root, root / "b", 64, "--num-proc", "2")) == 0
    assert (root / "a" / "vocab.safetensors").read_bytes() == (
        root / "b" / "vocab.safetensors"
    ).read_bytes()
    other = json.loads((root / "b" / "report.json").read_text())
    assert other.pop("prepared") != report.pop("prepared") and other == report
    import eagletools.vocab

    def fail(*args):
        raise AssertionError("the vocabulary should come from the cache")

    monkeypatch.setattr(eagletools.vocab, "build_vocab", fail)
    assert main(build_argv(root, root / "c", 64)) == 0
    assert (root / "c" / "vocab.safetensors").read_bytes() == (
        root / "a" / "vocab.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(("size", "message"), [(0, "at least 1"), (401, "larger than")])
def test_cli_bad_size_exits_2_and_writes_nothing(tiny_target, capsys, size, message):
    assert main(build_argv(tiny_target, tiny_target / "out", size)) == 2
    assert message in capsys.readouterr().err
    assert not (tiny_target / "out").exists()


def test_cli_missing_data_file(tiny_target, capsys):
    (tiny_target / "d.jsonl").unlink()
    assert main(build_argv(tiny_target, tiny_target / "out", 8)) == 2
    assert "d.jsonl'" in capsys.readouterr().err and not (tiny_target / "out").exists()


def test_cli_unknown_builtin_target(tmp_path, capsys):
    argv = ["vocab", "build", "--target", "smol", "--data", "sharegpt", "--size", "8"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert "built-in targets: smollm2-135m" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
@pytest.mark.slow  # tokenises 2000 ShareGPT conversations (~30 s) unless cached
def test_acceptance_build_equals_recount(tmp_path):
    """The README demo: coverage >= 0.95 and d2t/t2d equal to a plain recount."""
    import datasets

    out = tmp_path / "vocab"
    argv = ["vocab", "build", "--target", "smollm2-135m", "--data", "sharegpt"]
    assert main([*argv, "--num-samples", "2000", "--size", "16384", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["coverage"] >= 0.95 and report["target_vocab_size"] == 49152
    vocab = DraftVocab.load(out / "vocab.safetensors")
    rows = datasets.load_from_disk(str(Path(report["prepared"]) / "dataset"))
    assert len(rows) == report["num_samples"] > 1900
    selected, coverage = recount(rows, 49152, 16384)
    assert vocab.selected.tolist() == selected
    assert torch.equal(vocab.t2d.nonzero().flatten(), torch.tensor(selected))
    assert report["coverage"] == pytest.approx(coverage)
