"""The offline hidden-state cache: run the target once, train the draft for many epochs.

Layout of a cache folder:

    manifest.json                 target identity, aux layer ids, data key, job, shards
    target/config.json            the target's config (to size the draft)
    target/head.safetensors       embed_tokens, lm_head and final norm weights
    shards/shard-NNNNN.safetensors

A shard holds the samples [k*S, (k+1)*S) of the prepared dataset, concatenated
along tokens: `input_ids` int32 [N], `loss_mask` int8 [N], `aux` bf16 [N, A*Ht],
`last_hidden` bf16 [N, Ht] and `offsets` int64 [n+1]; so a token costs
(A+1)*Ht*2 + 5 bytes. Rank r of W writes the shards k with k % W == r; a
shard file exists only once complete (atomic), so a rerun resumes where the
last one stopped. Readers memory-map the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools.atomic import atomic_file, write_text
from eagletools.data.batch import Sample, SampleSource, pad_right
from eagletools.data.captures import Captures
from eagletools.errors import UserError
from eagletools.targets.anatomy import decoder_layers, embed_tokens, final_norm, lm_head

log = logging.getLogger(__name__)

VERSION = 1


def target_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the target's sizes and a few of its weights (bf16-rounded, so a
    bf16 and an fp32 load of the same model agree)."""
    digest = hashlib.sha256()
    config = model.config
    for name in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
        digest.update(f"{name}={getattr(config, name, None)};".encode())
    pieces = [final_norm(model).weight, lm_head(model).weight[:64],
              decoder_layers(model)[0].self_attn.q_proj.weight[:16]]  # fmt: skip
    for p in pieces:
        digest.update(p.detach().to(torch.bfloat16).float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def shard_path(root: Path, k: int) -> Path:
    return root / "shards" / f"shard-{k:05d}.safetensors"


def _identity(
    target: Any, layer_ids: list[int], data_key: str, max_length: int, job: dict | None
) -> dict:
    identity = {
        "version": VERSION,
        "target": {
            "name_or_path": target.info.name_or_path,
            "fingerprint": target_fingerprint(target.model),
            "hidden_size": target.info.hidden_size,
            "vocab_size": target.info.vocab_size,
            "num_layers": target.info.num_layers,
        },
        "aux_layer_ids": list(layer_ids),
        "data_key": data_key,
        "max_length": max_length,
        "dtype": "bfloat16",
    }
    return identity if job is None else {**identity, "job": job}


def _check_identity(found: dict, want: dict, root: Path) -> None:
    for key, what in (("target", "target"), ("aux_layer_ids", "aux layer ids"),
                      ("data_key", "data"), ("max_length", "max length")):  # fmt: skip
        if found.get(key) != want[key]:
            raise UserError(
                f"{root}/manifest.json: this cache was made with another {what} "
                f"({found.get(key)} vs {want[key]}); use a new output folder, or the same "
                "target, layers and data to resume it"
            )
    if "job" in found and "job" in want and found["job"] != want["job"]:
        raise UserError(
            f"{root}/manifest.json: this cache was made with other settings ({found['job']} "
            f"vs {want['job']}); use a new output folder, or the same settings to resume it"
        )


def manifest_job(path: str | Path) -> dict | None:
    """The settings a complete cache was made with (`data.jobs`); None while incomplete."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        return None
    found = json.loads(manifest.read_text())
    return found.get("job") if found.get("complete") else None


def write_hidden_states(
    target: Any,
    dataset: Any,
    output_dir: str | Path,
    *,
    data_key: str,
    max_length: int,
    layer_ids: list[int] | None = None,
    shard_size: int = 256,
    batch_tokens: int = 8192,
    rank: int | None = None,
    world_size: int | None = None,
    captured: str | Path | None = None,
    job: dict | None = None,
) -> Path:
    """Capture aux and last hidden states of every sample into `output_dir`.

    `rank`/`world_size` default to the RANK/WORLD_SIZE that `accelerate launch`
    or torchrun set. `captured`: a regeneration's parts folder; a sample whose
    states it kept at these layers takes them (and the reply's tokens as the
    target wrote them, `data.captures`) instead of a run through the target.
    `job`: the settings behind the cache (`data.jobs`), kept in the manifest.
    Returns the cache folder; its manifest is complete once every shard of
    every rank exists.
    """
    from tqdm.auto import tqdm

    from eagletools.targets import resolve_aux_layer_ids

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    root = Path(output_dir)
    layer_ids = resolve_aux_layer_ids(layer_ids, target.info.num_layers)
    identity = _identity(target, layer_ids, data_key, max_length, job)
    _start_manifest(root, target, identity, rank)
    n = len(dataset)
    if n == 0:
        raise UserError("the dataset is empty after filtering: nothing to cache")
    num_shards = (n + shard_size - 1) // shard_size
    mine = [k for k in range(num_shards) if k % world_size == rank]
    todo = [k for k in mine if not shard_path(root, k).is_file()]
    if len(todo) < len(mine):
        log.info("rank %d: %d of %d shards already cached", rank, len(mine) - len(todo), len(mine))
    captures = Captures.open(Path(captured), layer_ids) if captured else None
    reused = 0
    for k in tqdm(todo, desc=f"hidden states (rank {rank})", unit="shard", disable=not todo):
        rows = dataset[k * shard_size : min((k + 1) * shard_size, n)]
        samples = _Rows.read(rows, captures, max_length, target.info.hidden_size)
        samples.run_target(target.model, layer_ids, batch_tokens)
        reused += samples.reused
        _write_shard(shard_path(root, k), samples.tensors())
    if captures is not None:
        log.info("rank %d: %d samples from the regeneration's captured states, the rest "
                 "through the target", rank, reused)  # fmt: skip
    _finish_manifest(root, identity, num_shards, shard_size, n)
    return root


def _start_manifest(root: Path, target: Any, identity: dict, rank: int) -> None:
    """Check an existing cache's identity (a resume), or start a new one on rank 0."""
    manifest_path = root / "manifest.json"
    if manifest_path.is_file():
        _check_identity(json.loads(manifest_path.read_text()), identity, root)
    elif rank == 0:
        write_text(manifest_path, json.dumps({**identity, "complete": False}, indent=2))
        _write_head(target, root)


@dataclass
class _Rows:
    """One shard's samples: tokens, loss masks, and their states as they are found."""

    ids: list[torch.Tensor]
    masks: list[torch.Tensor]
    aux: list[torch.Tensor | None]
    last: list[torch.Tensor | None]
    reused: int = 0  # samples whose states came from the regeneration's captures

    @classmethod
    def read(cls, rows: dict, captures: Captures | None, max_length: int, hidden: int) -> _Rows:
        """The rows' tokens; a sample the captures hold takes the last reply as the target
        wrote it, with its states."""
        ids = [torch.as_tensor(x, dtype=torch.long) for x in rows["input_ids"]]
        masks = [torch.as_tensor(x, dtype=torch.int8) for x in rows["loss_mask"]]
        out = cls(ids, masks, [None] * len(ids), [None] * len(ids))
        for i, (sample, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True)):
            found = captures.lookup(list(sample), list(mask), max_length) if captures else None
            if found is not None:
                out.ids[i], out.masks[i], states = found
                out.aux[i], out.last[i] = states[:, :-hidden], states[:, -hidden:]
                out.reused += 1
        return out

    def run_target(self, model: torch.nn.Module, layer_ids: list[int], batch_tokens: int) -> None:
        """The states of the samples still without, longest first, about `batch_tokens` a
        forward."""
        from eagletools.targets import capture_aux

        ids = self.ids
        order = sorted((i for i in range(len(ids)) if self.aux[i] is None),
                       key=lambda i: -ids[i].numel())  # fmt: skip
        while order:
            width = ids[order[0]].numel()
            take = order[: max(1, batch_tokens // width)]
            order = order[len(take) :]
            batch_ids = pad_right([ids[i] for i in take], width)
            attention = pad_right([torch.ones_like(ids[i]) for i in take], width)
            out = capture_aux(model, batch_ids.to(model.device), attention.to(model.device),
                              layer_ids)  # fmt: skip
            for row, i in enumerate(take):
                length = ids[i].numel()
                self.aux[i] = out.aux[row, :length].to(torch.bfloat16).cpu()
                self.last[i] = out.last_hidden[row, :length].to(torch.bfloat16).cpu()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The shard file's tensors (layout in the module docstring)."""
        lengths = torch.tensor([0] + [x.numel() for x in self.ids])
        return {
            "input_ids": torch.cat(self.ids).to(torch.int32),
            "loss_mask": torch.cat(self.masks),
            "aux": torch.cat(self.aux),  # type: ignore[arg-type]
            "last_hidden": torch.cat(self.last),  # type: ignore[arg-type]
            "offsets": lengths.cumsum(0),
        }


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp))


def _write_head(target: Any, root: Path) -> None:
    from safetensors.torch import save_file

    model = target.model
    head = {
        "embed_tokens.weight": embed_tokens(model).weight,
        "lm_head.weight": lm_head(model).weight,
        "norm.weight": final_norm(model).weight,
    }
    head = {k: v.detach().to(torch.bfloat16).cpu().contiguous().clone() for k, v in head.items()}
    (root / "target").mkdir(parents=True, exist_ok=True)
    with atomic_file(root / "target" / "head.safetensors") as tmp:
        save_file(head, str(tmp))
    write_text(root / "target" / "config.json", model.config.to_json_string())


def _finish_manifest(root: Path, identity: dict, num_shards: int, shard_size: int, n: int) -> None:
    """Once every shard exists (any rank may be last), record them and mark complete."""
    from safetensors import safe_open

    if not all(shard_path(root, k).is_file() for k in range(num_shards)):
        return
    shards, tokens = [], 0
    for k in range(num_shards):
        with safe_open(str(shard_path(root, k)), "pt") as f:
            count = f.get_slice("offsets").get_shape()[0] - 1
            num_tokens = f.get_slice("input_ids").get_shape()[0]
        shards.append({"file": shard_path(root, k).name, "samples": count, "tokens": num_tokens})
        tokens += num_tokens
    manifest = {**identity, "complete": True, "num_samples": n, "num_tokens": tokens,
                "shard_size": shard_size, "shards": shards}  # fmt: skip
    write_text(root / "manifest.json", json.dumps(manifest, indent=2))


@dataclass
class _Sample:
    shard: int
    start: int
    end: int


class HiddenStateCache(SampleSource):
    """A complete cache, memory-mapped; a `SampleSource` for the trainer."""

    def __init__(self, root: Path, manifest: dict):
        from safetensors import safe_open

        self.root, self.manifest = root, manifest
        self.aux_layer_ids: list[int] = manifest["aux_layer_ids"]
        self.files = [safe_open(str(root / "shards" / s["file"]), "pt") for s in manifest["shards"]]
        self.samples: list[_Sample] = []
        self.masks: list[torch.Tensor] = []
        for k, f in enumerate(self.files):
            offsets = f.get_tensor("offsets").tolist()
            mask = f.get_tensor("loss_mask")
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                self.samples.append(_Sample(k, a, b))
                self.masks.append(mask[a:b].long())

    @staticmethod
    def is_complete(path: str | Path) -> bool:
        manifest = Path(path) / "manifest.json"
        return manifest.is_file() and bool(json.loads(manifest.read_text()).get("complete"))

    @classmethod
    def open(cls, path: str | Path) -> HiddenStateCache:
        root = Path(path)
        manifest_path = root / "manifest.json"
        if not manifest_path.is_file():
            raise UserError(
                f"{root}: no manifest.json; make a cache with `eagletools data hidden-states`"
            )
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("version") != VERSION:
            raise UserError(
                f"{manifest_path}: cache version {manifest.get('version')}, this eagletools "
                f"reads version {VERSION}; rebuild the cache"
            )
        if not manifest.get("complete"):
            raise UserError(
                f"{manifest_path}: the cache is incomplete; rerun `eagletools data hidden-states` "
                "with the same arguments to finish it"
            )
        return cls(root, manifest)

    def check_target(self, spec: str, source: str = "target.spec") -> None:
        made_for = self.manifest["target"]["name_or_path"]
        if spec != made_for:
            raise UserError(
                f"{self.root}/manifest.json: the cache was made for target {made_for!r}, but "
                f"{source} is {spec!r}; set {source}={made_for} or rebuild the cache"
            )

    def check_layers(self, layer_ids: list[int], source: str = "aux layer ids") -> None:
        if list(layer_ids) != self.aux_layer_ids:
            raise UserError(
                f"{self.root}/manifest.json: the cache holds aux layers {self.aux_layer_ids}, "
                f"but {source} is {list(layer_ids)}; use those layers or rebuild the cache"
            )

    def target_skeleton(self) -> torch.nn.Module:
        """The target on the meta device with only its embeddings, final norm and
        lm_head materialised: enough to size and initialise a draft."""
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        config_dict = json.loads((self.root / "target" / "config.json").read_text())
        config = AutoConfig.for_model(**config_dict)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        head = load_file(str(self.root / "target" / "head.safetensors"))

        def param(name: str) -> torch.nn.Parameter:
            return torch.nn.Parameter(head[name], requires_grad=False)

        embed_tokens(model).weight = param("embed_tokens.weight")
        lm_head(model).weight = param("lm_head.weight")
        final_norm(model).weight = param("norm.weight")
        return model

    # -- SampleSource -------------------------------------------------------

    def __len__(self) -> int:
        return len(self.samples)

    def length(self, index: int) -> int:
        s = self.samples[index]
        return s.end - s.start

    def loss_mask(self, index: int) -> torch.Tensor:
        return self.masks[index]

    def _read(self, index: int, name: str) -> torch.Tensor:
        s = self.samples[index]
        return self.files[s.shard].get_slice(name)[s.start : s.end]

    def sample(self, index: int) -> Sample:
        ids = self._read(index, "input_ids").long()
        return Sample(ids, self.masks[index], self._read(index, "aux"),
                      self._read(index, "last_hidden"))  # fmt: skip

    def bytes_per_token(self) -> float:
        size = sum(
            (self.root / "shards" / s["file"]).stat().st_size for s in self.manifest["shards"]
        )
        return size / self.manifest["num_tokens"]
