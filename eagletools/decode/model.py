"""A gpt-fast-style Llama-family transformer for decoding, in one file.

Built from a loaded Hugging Face model's weights (Llama 2/3, Qwen2/2.5 with
qkv bias, Qwen3 with q/k norm, Mistral, SmolLM2). What HF's forward does not
give a tree decoder cheaply: a preallocated static KV cache written at explicit
slots, explicit RoPE positions, a custom (tree) mask over the new tokens, and
the aux hidden states of chosen layers from the same pass. Fused q/k/v and
gate/up projections keep the per-token Python and matmul count low on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagletools import kernels
from eagletools.attention import causal_attention, heads_for_mask
from eagletools.compiling import compile_frozen
from eagletools.cpu_ops import PackedLinear, attention_op, batched_product
from eagletools.draft.model import RMSNorm, meta_device
from eagletools.errors import UserError
from eagletools.rope import RotaryEmbedding
from eagletools.targets import anatomy
from eagletools.targets.anatomy import DEFAULT_ROPE_THETA

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelArgs:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_seq_len: int  # the target's context (capped by a sliding window if any)
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048  # what the RoPE scaling is computed for

    @classmethod
    def from_hf_config(cls, config) -> ModelArgs:
        if config.model_type not in SUPPORTED:
            raise UserError(
                f"target model_type {config.model_type!r} is not supported by the decoder; "
                f"supported: {', '.join(SUPPORTED)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UserError(f"target hidden_act {config.hidden_act!r}: only 'silu' is supported")
        context = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or []
        slides = "sliding_attention" in layer_types or config.model_type == "mistral"
        if window and slides:
            context = min(context, window)  # within the window, sliding == full attention
        rope_theta, rope_scaling = anatomy.rope_of(config)
        return cls(
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            max_seq_len=context,
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", 0)),
            qk_norm=config.model_type == "qwen3",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )


def causal(n: int, device=None) -> torch.Tensor:
    """[n, n] bool: each new token sees itself and the ones before it."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def extend_mask(
    start: int, n: int, tree_mask: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """[n, start+n] bool: the prefix fully visible, then `tree_mask` (default causal)."""
    if tree_mask is None:
        tree_mask = causal(n, device)
    return torch.cat([tree_mask.new_ones(n, start), tree_mask], dim=1)


def cache_mask(
    start: torch.Tensor, n: int, size: int, tree_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, size] bool over a whole cache of `size` slots, the new tokens at slots
    `start..` (a 0-d device tensor): earlier slots visible, the new ones by
    `tree_mask` (default causal), later ones hidden. Its shape does not depend
    on `start`, so a captured CUDA graph replays it for any length."""
    if tree_mask is None:
        tree_mask = causal(n, start.device)
    rel = torch.arange(size, device=start.device) - start  # slot - start
    in_tree = tree_mask.gather(1, rel.clamp(0, n - 1).expand(n, size))
    return (rel < 0) | (in_tree & (rel < n))


CACHE_BLOCK = 256  # KV caches are sized in whole blocks of slots


def cache_size(needed: int, current: int, limit: int) -> int:
    """Slots a cache of `current` slots grows to so that it holds `needed`.

    At least double the current size (a growing conversation reallocates
    O(log n) times), rounded up to a block, never beyond `limit` (the context).
    """
    if needed <= current:
        return current
    size = -(-max(needed, 2 * current) // CACHE_BLOCK) * CACHE_BLOCK
    return min(size, limit)


def grown(cache: torch.Tensor, max_len: int) -> torch.Tensor:
    """`cache` [..., S, D] with room for `max_len` slots, its contents kept."""
    out = cache.new_zeros(*cache.shape[:-2], max_len, cache.shape[-1])
    out[..., : cache.shape[-2], :] = cache
    return out


class KVCache:
    """K and V of every layer, one tensor each: [n_layers, B, n_kv_heads, S_max, head_dim].

    One tensor, not one per layer: after verification `compact` moves every
    layer's accepted entries in one op, not one per layer (on CUDA one launch;
    timed in docs/lab.md, Part 3).
    Layer i reads and writes its views `layers[i]`.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.layers = list(zip(k.unbind(0), v.unbind(0), strict=True))

    @classmethod
    def allocate(
        cls, n_layers: int, batch: int, n_kv: int, max_len: int, head_dim: int, dtypes, device
    ) -> KVCache:
        """`dtypes`: (K's, V's)."""
        shape = (n_layers, batch, n_kv, max_len, head_dim)
        return cls(*(torch.zeros(shape, dtype=dtype, device=device) for dtype in dtypes))

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def size(self) -> int:
        """Slots per layer."""
        return self.k.shape[3]

    def grown(self, max_len: int) -> KVCache:
        """This cache with room for `max_len` slots, its contents kept."""
        return KVCache(grown(self.k, max_len), grown(self.v, max_len))

    def compact(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """In every layer, the entries at `src_slots` [B,n] (negative: none) move to
        slots `dst_start..` (`kernels.compact_kv`)."""
        kernels.compact_kv(self.k, self.v, src_slots, dst_start)


def write_kv(
    kv: tuple[torch.Tensor, torch.Tensor],
    start: int | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's new k, v [B,Hkv,T,D] into its cache `kv` at slots `start..`.

    Returns the K/V attention reads: slots `< start + T`, or every slot when
    `start` is a 0-d device tensor (the host does not know its value; the
    mask hides the slots after the new ones).
    """
    cache_k, cache_v = kv
    t = k.shape[2]
    if isinstance(start, torch.Tensor):
        slots = start + torch.arange(t, device=k.device)
        cache_k.index_copy_(2, slots, k.to(cache_k.dtype))
        cache_v.index_copy_(2, slots, v.to(cache_v.dtype))
        return cache_k, cache_v
    end = start + t
    cache_k[:, :, start:end] = k
    cache_v[:, :, start:end] = v
    return cache_k[:, :, :end], cache_v[:, :, :end]


def attention(q, k, v, mask: torch.Tensor | None, exact: bool = True) -> torch.Tensor:
    """q [B,Hq,T,D] over k, v [B,Hkv,S,D]; mask [T,S] or [B,T,S] bool (True = attend), or
    None: the T queries are the last T keys, each seeing the keys up to itself.

    On CPU, for the few queries of decoding and tree verification, fp32
    matmuls with the query heads grouped per KV head beat CPU SDPA (its flash
    path pays per key block) and bf16 matmuls (docs/lab.md, Part 3); long
    prefills keep SDPA. On GPU, SDPA in the model's dtype: no fp32 copy of the KV cache.

    `exact` (CPU): a query's output does not depend on which other queries
    share the call or where in a tree its keys sit, so speculative decoding
    reproduces plain decoding in bf16. Scores are one product per (query, key)
    and equal bit for bit however many queries share the call (a lone query
    runs as two; pinned in tests); the softmax sum and the value sum, whose
    rounding follows each key's place in the row, run in float64, where that
    order moves a result by ~1e-16, 2^-40 of the bf16 step the output is
    rounded to. Eagerly over the decoder's caches all of it is one C++ call
    (`cpu_ops.attention_op`), where each query sums its visible keys in slot
    order, so hidden keys between them change nothing, bit for bit.
    """
    b, hq, t, d = q.shape
    s = k.shape[2]
    per_row = mask is not None and mask.dim() == 3  # [B,T,S]: a left-padded batch
    if t > 64 or q.device.type != "cpu":
        k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            return causal_attention(q, k, v)
        attn_mask = mask[:, None] if per_row else mask
        k, v = heads_for_mask(q, k), heads_for_mask(q, v)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, enable_gqa=k.shape[1] != hq
        )
    if mask is None and t > 1:
        mask = extend_mask(s - t, t, device=q.device)
    if (op := attention_op(q, k, v)) is not None:  # eagerly: the same numerics, one call
        return op(q, k, v, mask, d**-0.5)
    if exact and t == 1:
        # a lone query's fp32 score product takes another GEMM kernel on some CPUs (an
        # EPYC, Zen 4), rounding apart from the many-query one: run it as two copies
        mask = None if mask is None else mask.expand(*mask.shape[:-2], 2, s)
        return _grouped_attention(q.expand(b, hq, 2, d), k, v, mask, exact)[:, :, :1]
    return _grouped_attention(q, k, v, mask, exact)


def _grouped_attention(q, k, v, mask: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """`attention`'s few-query CPU path; mask None: every key visible."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    per_row = mask is not None and mask.dim() == 3
    group = hq // hkv
    q32 = q.reshape(b * hkv, group * t, d).float()
    # a V cache already in this dtype (`Transformer.cache_dtypes`) is not converted
    k = k.float().reshape(b * hkv, s, d)
    v = v.reshape(b * hkv, s, d).to(torch.float64 if exact else torch.float32)
    scores = batched_product(q32, k.transpose(1, 2), d**-0.5)
    if mask is not None:
        mask = mask[:, None, None] if per_row else mask
        scores = scores.view(b, hkv, group, t, s).masked_fill(~mask, float("-inf"))
    scores = scores.view(b * hkv, group * t, s)
    if exact:
        scores = scores.double()
    return batched_product(scores.softmax(-1), v).to(q.dtype).view(b, hq, t, d)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = PackedLinear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = PackedLinear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.exact = True  # batch-invariant attention (`attention`); Transformer.set_exact
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x, cos, sin, start, mask, kv, tree_mask=None) -> torch.Tensor:
        """`kv`: this layer's cache views; `tree_mask` [T,T] given: the Triton tree kernel."""
        b, t, _ = x.shape
        q_size, kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        qk, v = self.wqkv(x).split([q_size + kv_size, kv_size], dim=-1)
        qk = qk.view(b, t, self.n_heads + self.n_kv, self.hd)
        if hasattr(self, "q_norm"):
            q, k = qk.split([self.n_heads, self.n_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        # q and k heads in one pass; `sin` carries rotate_half's sign: fewer ops per layer
        qk = qk * cos + qk.roll(self.hd // 2, -1) * sin
        q, k = qk.transpose(1, 2).split([self.n_heads, self.n_kv], dim=1)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        k, v = write_kv(kv, start, k, v)
        if tree_mask is not None:  # verification: Triton
            out = kernels.tree_attention(q, *kv, start, tree_mask, self.hd**-0.5)
        else:
            out = attention(q, k, v, mask, self.exact)
        return self.wo(out.transpose(1, 2).reshape(b, t, q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = PackedLinear(args.dim, 2 * args.intermediate_size, bias=False)
        self.w2 = PackedLinear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, cos, sin, start, mask, kv, tree_mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, start, mask, kv, tree_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = PackedLinear(args.dim, args.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        )
        self.kv_cache: KVCache | None = None
        # bumped by each new writer of the KV cache (`claim_cache`): a decoder that finds
        # the number it took there finds its own tokens in the cache
        self.cache_version = 0

    @classmethod
    @torch.no_grad()
    def from_hf(cls, model: nn.Module, dtype: torch.dtype | None = None) -> Transformer:
        """The weights of a loaded HF `*ForCausalLM`: q/k/v and gate/up fused (copies), the
        rest shared with it where the dtype is the same. Eval keeps the HF model (the draft's
        embedding, `--hf-baseline`), and copies of the embedding, head and o/down projections
        were 2.4 GB of a 3 GB 2-layer 8B-wide target (benchmarks/scale_check.py)."""
        args = ModelArgs.from_hf_config(model.config)
        dtype = dtype or model.dtype
        device = model.device
        with meta_device():
            self = cls(args)
        self.to_empty(device=device)  # untouched pages: the shared ones below cost nothing

        def share(module: nn.Module, source: nn.Parameter | torch.Tensor) -> None:
            module.weight = nn.Parameter(source.detach().to(dtype), requires_grad=False)

        share(self.tok_embeddings, anatomy.embed_tokens(model).weight)
        share(self.output, anatomy.lm_head(model).weight)
        self.norm.weight.copy_(anatomy.final_norm(model).weight)
        for block, layer in zip(self.layers, anatomy.decoder_layers(model), strict=True):
            a, m = layer.self_attn, layer.mlp
            projs = (a.q_proj, a.k_proj, a.v_proj)
            if a.o_proj.bias is not None or m.down_proj.bias is not None:
                raise UserError("target has o_proj/MLP biases, which the decoder does not support")
            block.attention.wqkv.weight.copy_(torch.cat([p.weight for p in projs]))
            if args.qkv_bias:
                block.attention.wqkv.bias.copy_(torch.cat([p.bias for p in projs]))
            share(block.attention.wo, a.o_proj.weight)
            if args.qk_norm:
                block.attention.q_norm.weight.copy_(a.q_norm.weight)
                block.attention.k_norm.weight.copy_(a.k_norm.weight)
            block.feed_forward.w13.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            share(block.feed_forward.w2, m.down_proj.weight)
            block.attention_norm.weight.copy_(layer.input_layernorm.weight)
            block.ffn_norm.weight.copy_(layer.post_attention_layernorm.weight)
        self = self.to(dtype).eval()
        # computed, not loaded: made off the meta device, and kept in fp32 as HF keeps it
        self.rotary = RotaryEmbedding(
            args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings
        ).to(device)
        self.register_buffer("rope", self.rope_table(args.max_seq_len), persistent=False)
        return self

    def rope_table(self, size: int) -> torch.Tensor:
        """[2, size, head_dim]: cos and signed sin of positions `0..size-1`, in the model's dtype.

        Read, not computed, per step: a token's rotation is then the same bits
        whatever else a call holds (compiled, cos of 1 and of 6 positions ran
        through different instructions and differed), and a step runs no trig.
        The sign is rotate_half's: x.roll(half) * signed sin == rotate_half(x) * sin.
        Its size is the context's: 64 MB for a 128k-token context at head_dim 128 in bf16.
        """
        cos, sin = self.rotary(torch.arange(size, device=self.device), self.dtype)
        half = sin.shape[-1] // 2
        return torch.stack([cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)])

    def set_exact(self, exact: bool) -> None:
        """Batch-invariant attention and linears (the default) or the faster fp32
        attention (`attention`) and one-row products (`cpu_ops.packed_linear`)."""
        for block in self.layers:
            block.attention.exact = exact
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.invariant = exact
        cache, (_, v_dtype) = self.kv_cache, self.cache_dtypes()
        if cache is not None and cache.v.dtype != v_dtype:
            self.kv_cache = KVCache(cache.k, cache.v.to(v_dtype))

    def cache_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """K's and V's: what attention computes in, so no step converts the cache.

        On CPU, K in fp32 and V in fp32, or fp64 under exact attention (both hold
        the bf16 values exactly; converting V per step moved ~20 MB per token at
        300 tokens of context for SmolLM2, by count, not timed); the model's dtype elsewhere.
        """
        if self.device.type != "cpu":
            return self.dtype, self.dtype
        return torch.float32, torch.float64 if self.exact else torch.float32

    @property
    def exact(self) -> bool:
        return self.layers[0].attention.exact

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def cache_len(self) -> int:
        """Slots of the KV cache (0 before `setup_caches`)."""
        return 0 if self.kv_cache is None else self.kv_cache.size

    def setup_caches(self, batch: int, max_len: int) -> None:
        """Empty K/V for `max_len` slots (at most the context) of `batch` rows; what a
        decoder had cached is gone (a new version, `claim_cache`)."""
        self.claim_cache()
        max_len = min(max_len, self.args.max_seq_len)
        cache = self.kv_cache
        if cache is not None and cache.size == max_len and cache.batch == batch:
            return
        a = self.args
        self.kv_cache = KVCache.allocate(
            a.n_layers, batch, a.n_kv_heads, max_len, a.head_dim, self.cache_dtypes(), self.device
        )

    def claim_cache(self) -> int:
        """A new version of the KV cache's contents, for a writer about to change them."""
        self.cache_version += 1
        return self.cache_version

    def reserve(self, length: int, limit: int | None = None) -> None:
        """A batch-1 cache of at least `length` slots (`cache_size`'s rule, at most
        `limit` or the context), its contents kept when it grows."""
        limit = min(limit or self.args.max_seq_len, self.args.max_seq_len)
        size = cache_size(length, self.cache_len, limit)
        if self.kv_cache is None or self.kv_cache.batch != 1:
            self.setup_caches(1, size)
        elif size > self.cache_len:
            self.kv_cache = self.kv_cache.grown(size)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        start: int | torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        aux_layer_ids: Sequence[int] = (),
        last_only: bool = False,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens whose K/V go to cache slots `start..start+T-1`.

        input_ids [B,T]; positions [T] (RoPE). Slots `< start` are fully visible;
        among the new tokens `tree_mask` [T,T] (True = attend; default causal)
        decides. Returns logits [B,T,V] (or [B,1,V] with `last_only`) and the
        hidden states at `aux_layer_ids` (HF indexing: k = input of layer k, N =
        the final norm's output, as `target.capture_aux`) concatenated [B,T,A*H],
        or None. `key_mask` [B,>=start+T] (False = a
        padding slot) hides each row's padding from its real tokens.

        `start` as a 0-d device tensor (what a CUDA graph replays with new
        lengths): attention spans the whole cache under `cache_mask`, so no
        shape or host decision depends on its value; the caller checks that
        the tokens fit.
        """
        t = input_ids.shape[1]
        on_device = isinstance(start, torch.Tensor)
        if not on_device and start + t > self.cache_len:
            raise UserError(
                f"sequence of {start + t} tokens exceeds the KV cache / context of "
                f"{self.cache_len} tokens: shorten the prompt or --max-new-tokens"
            )
        if on_device and key_mask is not None:
            raise ValueError("key_mask needs an int start (the batched path)")
        mask = None
        if on_device:
            mask = cache_mask(start, t, self.cache_len, tree_mask)
        elif tree_mask is not None or key_mask is not None or 1 < t <= 64:
            mask = extend_mask(start, t, tree_mask, self.device)  # longer: causal, maskless
        tree = None  # the new tokens' own block, for the Triton tree kernel
        if mask is not None and key_mask is None and t <= 64 and kernels.use_triton(input_ids):
            tree = tree_mask if tree_mask is not None else causal(t, self.device)
        if key_mask is not None:
            mask = mask & key_mask[:, None, : start + t]
            # a padding query sees itself, so its (unused) output stays finite
            mask[..., start:] |= torch.eye(t, dtype=torch.bool, device=self.device)
        cos, sin = self.rope[:, positions].unsqueeze(-2).unbind(0)  # [T,1,hd] each
        x = self.tok_embeddings(input_ids)
        states = {}
        for i, (block, kv) in enumerate(zip(self.layers, self.kv_cache.layers, strict=True)):
            if i in aux_layer_ids:
                states[i] = x
            x = block(x, cos, sin, start, mask, kv, tree)
        x = states[len(self.layers)] = self.norm(x)
        aux = torch.cat([states[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        if last_only:
            x = x[:, -1:]
        return self.output(x), aux


def compiled(model: Transformer) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """`model`'s decode and verify forward, compiled by inductor with the weights frozen
    (packed once): `(input_ids, positions, start, tree_mask=None, aux_layer_ids=())`.

    The norms, rotary, SiLU and attention's softmax fuse into a few kernels
    instead of ~1,600 eager ops per token, and the linears are inductor's own
    (`compiling.cpu_gemm_template`), faster than oneDNN's for a few rows
    (docs/lab.md, Part 3).

    A row's result never depends on the call. A lone token runs as the root of
    a two-node chain (itself twice; the copy's K/V lands in the next slot, which
    the next token overwrites), shaped as a tree verification: inductor fuses a
    linear with the residual add after it (one bf16 rounding instead of two)
    only where their shapes match, so one-row and many-row graphs differed.
    Compiled and eager results differ in bf16 (fusion skips roundings);
    compiled speculative decoding equals compiled plain decoding (tests).

    `start` is dynamic from the first call; each row count (a token, each tree
    size) and each KV cache allocation gets its own graph, about a minute to
    compile on 2 CPU cores. A graph dynamic in the row count too ran slower:
    its linears and attention lose their sizes (docs/lab.md, Part 3).
    """

    def step(input_ids, positions, start, tree_mask, aux_layer_ids):
        return model(input_ids, positions, start, tree_mask, aux_layer_ids)

    step = compile_frozen(step, "L['start']")
    pair = causal(2, model.device)

    def forward(input_ids, positions, start, tree_mask=None, aux_layer_ids=()):
        lone = input_ids.shape[1] == 1 and tree_mask is None
        if lone:
            input_ids, positions = input_ids.expand(-1, 2), positions.expand(2)
            tree_mask = pair
        logits, aux = step(input_ids, positions, start, tree_mask, tuple(aux_layer_ids))
        if lone:
            return logits[:, :1], None if aux is None else aux[:, :1]
        return logits, aux

    return forward
