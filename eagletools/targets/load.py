"""Load a target model and its tokenizer from whatever the user names.

A spec is a built-in name (`eagletools assets list`), a local Hugging Face
folder, a `.gguf` file (transformers dequantises it to float), or a hub id.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagletools import assets
from eagletools.errors import UserError
from eagletools.targets.anatomy import embed_tokens, rope_of, text_config
from eagletools.targets.folder import save_target_folder

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class TargetInfo:
    name_or_path: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    rms_norm_eps: float
    has_chat_template: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(
        cls, config: Any, name_or_path: str, tokenizer: Any = None, architecture: str | None = None
    ) -> TargetInfo:
        text = text_config(config)
        rope_theta, rope_scaling = rope_of(text)
        heads = text.num_attention_heads
        return cls(
            name_or_path=name_or_path,
            architecture=(config.architectures or [architecture or config.model_type])[0],
            model_type=config.model_type,
            num_layers=text.num_hidden_layers,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            has_chat_template=bool(tokenizer is not None and tokenizer.chat_template),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: Any
    info: TargetInfo

    @property
    def embeddings(self) -> torch.Tensor:
        """[V, H]: what checks ask of a target, as of a `TargetSummary`."""
        return embed_tokens(self.model).weight


def resolve_spec(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """(`from_pretrained` location, extra kwargs) for a target spec, or a UserError."""
    spec = str(spec)
    if spec in assets.ASSETS:
        asset = assets.get_asset(spec)
        if asset.kind != "target":
            raise UserError(f"built-in {spec!r} is a {asset.kind}, not a target; {_known()}")
        path = assets.resolve(spec)
        return str(path.parent), {"gguf_file": path.name}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"{path}: no such .gguf file; check the --target path")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"{path}: no config.json; give a Hugging Face model folder "
                "(config.json + weights), a .gguf file, a hub id or a built-in name"
            )
        return str(path), {}
    if _HUB_ID.match(spec) and not path.exists():
        return spec, {}
    if path.exists():
        raise UserError(f"{path}: not a model folder or a .gguf file")
    raise UserError(
        f"target {spec!r}: no such file or folder, not a hub id (org/name) and not a "
        f"built-in name; {_known()}"
    )


def _known() -> str:
    names = sorted(a.name for a in assets.ASSETS.values() if a.kind == "target")
    return "built-in targets: " + ", ".join(names)


def _load(loader: Any, spec: str, what: str, **kwargs: Any) -> Any:
    location, extra = resolve_spec(spec)
    try:
        return loader.from_pretrained(location, **extra, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        # transformers raises these for hub misses, unsupported GGUF
        # architectures and malformed folders; the user can fix each.
        hint = (
            "a GGUF of a Llama/Qwen2/Qwen3/Mistral architecture"
            if "gguf_file" in extra
            else "a local folder, or set HF_HUB_OFFLINE=0 with network for a hub id"
        )
        reason = str(err).strip().rstrip(".")
        raise UserError(
            f"could not load the {what} of target {spec!r}: {reason}. Use {hint}"
        ) from err


def load_tokenizer(spec: str | Path) -> Any:
    """The target's tokenizer alone (seconds, not the model's ~20 s)."""
    from transformers import AutoTokenizer

    return _load(AutoTokenizer, str(spec), "tokenizer")


def load_config(spec: str | Path) -> Any:
    """The target's model config alone (no weights)."""
    from transformers import AutoConfig

    return _load(AutoConfig, str(spec), "config")


def dequantised_folder(spec: str | Path) -> Path | None:
    """A GGUF target dequantised once into an HF folder (fp32) in the cache.

    The dequantisation runs once (timed in docs/lab.md, Part 3); every later load
    reads plain safetensors. The folder is keyed by the GGUF
    file's identity and written atomically under a lock, so concurrent loads
    and an interrupted first load are safe. None for non-GGUF specs.
    """
    location, extra = resolve_spec(spec)
    if "gguf_file" not in extra:
        return None
    gguf = (Path(location) / extra["gguf_file"]).resolve()
    stat = gguf.stat()
    # v2: folders that engines load too (architectures, the tied embedding by name)
    key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|v2"
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    folder = assets.cache_dir() / "dequantised" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            _write_dequantised(str(spec), folder)
    return folder


def _write_dequantised(spec: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = _load(AutoModelForCausalLM, spec, "model", dtype=torch.float32)
    save_target_folder(model, load_tokenizer(spec), folder, torch.float32, overwrite=True)


def load_target(
    spec: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    attention: str | None = None,
) -> Target:
    """The target's model and tokenizer; `attention` is Hugging Face's attn_implementation
    (None: its default)."""
    from transformers import AutoModelForCausalLM

    source = dequantised_folder(spec) or spec
    kwargs = {"attn_implementation": attention} if attention else {}
    model = _load(AutoModelForCausalLM, str(source), "model", dtype=dtype, **kwargs)
    model = model.to(device).eval()
    tokenizer = load_tokenizer(source)
    info = TargetInfo.from_config(model.config, str(spec), tokenizer, type(model).__name__)
    return Target(model, tokenizer, info)


def export_target(
    spec: str, folder: str | Path, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False
) -> Path:
    """Any target spec (built-in, .gguf, folder, hub id) as a complete HF folder."""
    target = load_target(spec, dtype=dtype)
    return save_target_folder(target.model, target.tokenizer, folder, dtype, overwrite)
