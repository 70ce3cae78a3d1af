"""Tree speculative decoding with an EAGLE-3 draft, and the plain baseline.

Both decoders run the same `Transformer` and share prefill, prefix reuse
across turns, sampling and stop handling, so their speed and outputs compare
like for like. Batch size 1.

A call's state is a `Generation` (the sequence, what each cache holds of it,
the stop reason, the drafts accepted per step), which every step takes and
returns; the decoder keeps the last one, so the next turn reuses the cached
prefix. Sampling and stopping live in `decode.sampling` and `decode.stopping`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from eagletools import kernels
from eagletools.compiling import compile_frozen
from eagletools.cpu_ops import argmax, pack_linears
from eagletools.decode.graphs import graphed
from eagletools.decode.model import Transformer, cache_mask, extend_mask, grown
from eagletools.decode.sampling import GREEDY, Sampling, choose
from eagletools.decode.stopping import Stopper, eos_token_ids
from eagletools.decode.tree import check_tree_shape, max_tree_nodes
from eagletools.devices import device_guard
from eagletools.errors import UserError
from eagletools.kinds import Drafter, kind_of


@dataclass
class Result:
    tokens: list[int]  # generated ids, cut at the stop
    text: str
    stop_reason: str  # "eos" | "max_tokens" | "stop_string" | "context"
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from the previous turn
    seconds: float
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step

    @property
    def steps(self) -> int:
        """Target forwards after prefill (verify steps; one per token for the baseline)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Acceptance length: tokens per verify step, bonus included."""
        return 1 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Generation:
    """One `generate` call's state: each step takes it and returns the next.

    `seq` is the conversation: the prompt, then every token generated, those
    after a stop too (the caches hold them, so the next turn may reuse them);
    the reply is the first `kept` after the prompt. The target's KV cache holds
    `seq[:target_len]` at slots `0..`, the draft's cache entries `0..draft_len-1`,
    entry p made from the target's aux states at p and the token p+1
    (docs/design.md 3.5 alignment). `seq` and `accepted` grow in place, a step's
    state sharing them with the one it replaces: copying 32k tokens took 50 us a step.
    """

    seq: list[int]
    prompt_len: int
    reused: int  # prompt tokens whose KV came from the previous turn
    target_len: int
    draft_len: int = 0
    kept: int = 0
    stop_reason: str = ""  # "" until stopped, then as `Result.stop_reason`
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify step
    # the draft's logits [Vd] and hidden [H] after the last token: the next tree grows from them
    draft_out: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def reply(self) -> list[int]:
        return self.seq[self.prompt_len : self.prompt_len + self.kept]


def extend(state: Generation, new: Sequence[int], stopper: Stopper) -> Generation:
    """`state` with the `new` tokens appended, checked for a stop (their text streamed)."""
    state.seq.extend(new)
    kept, reason = stopper.check(state.seq, state.kept)
    return replace(state, kept=kept, stop_reason=reason)


def out_of_context(state: Generation, stopper: Stopper) -> Generation:
    """Stopped for want of cache slots: the context is full."""
    stopper.emit("context")
    return replace(state, stop_reason="context")


def reusable(last: Generation | None, prompt: list[int], drafted: bool) -> int:
    """Prompt tokens whose cached KV (`last` left it) stays valid; one at least is run again.
    With a draft, entry p also needs token p+1 to match."""
    if last is None:
        return 0
    common = 0
    for a, b in zip(last.seq, prompt, strict=False):
        if a != b:
            break
        common += 1
    reuse = min(common, last.target_len, len(prompt) - 1)
    return max(0, min(reuse, common - 1, last.draft_len)) if drafted else reuse


Decode = Callable[..., Generation]  # (state, aux, stopper, sampling, generator) -> final state


@dataclass
class Session:
    """What a decoder keeps of the runtime between calls, and the call around its steps.

    Both decoders hold one, so prompt checks, prefix reuse, prefill and
    streaming are one code path: a decoder only brings the loop after the
    first token (`Decode`).
    """

    model: Transformer
    tokenizer: object  # None: token ids only, no text
    max_seq_len: int  # the cache never outgrows it
    margin: int  # cache slots a step needs beyond the sequence
    aux_ids: tuple[int, ...] = ()  # target hidden states the prefill must also return
    eos_ids: set[int] = field(default_factory=set)
    last: Generation | None = None  # the last call's state: what the caches hold
    cache_version: int = 0  # the runtime's, when this session last wrote its cache

    @classmethod
    def open(
        cls,
        model: Transformer,
        tokenizer,
        max_seq_len: int | None,
        margin: int,
        aux_ids: tuple[int, ...] = (),
    ) -> Session:
        context = model.args.max_seq_len
        eos = eos_token_ids(tokenizer) if tokenizer is not None else set()
        return cls(model, tokenizer, min(max_seq_len or context, context), margin, aux_ids, eos)

    def reset(self) -> None:
        """Forget the cached conversation (the next prompt is prefilled from scratch)."""
        self.last = None

    def reserve(self, length: int) -> None:
        """The runtime's KV cache for this session, `length` slots at least.

        It holds what this run needs (prompt + new tokens + a tree), not the
        whole context, and grows as a conversation does (`Transformer.reserve`).
        Another writer since this session's last call (a decoder, a batch) left
        a newer version: then nothing cached is ours.
        """
        self.model.reserve(length, self.max_seq_len)
        if self.model.cache_version != self.cache_version:
            self.reset()
        self.cache_version = self.model.claim_cache()

    def check_prompt(self, prompt: Sequence[int]) -> list[int]:
        prompt = list(prompt)
        if not prompt:
            raise UserError("the prompt is empty: give at least one token of text")
        room = self.max_seq_len - self.margin
        if len(prompt) > room:
            raise UserError(
                f"the prompt has {len(prompt)} tokens but the context holds "
                f"{self.max_seq_len} (minus {self.margin} for drafting): shorten the prompt"
            )
        return prompt

    def prefill(self, state: Generation):
        """Run the prompt after the reused prefix: (last logits [V], aux [1,T,A*H] or None)."""
        model, reuse, end = self.model, state.reused, state.prompt_len
        ids = torch.tensor([state.seq[reuse:end]], device=model.device)
        positions = torch.arange(reuse, end, device=model.device)
        logits, aux = model(ids, positions, reuse, aux_layer_ids=self.aux_ids, last_only=True)
        return logits[0, -1], aux

    @torch.inference_mode()
    def generate(
        self,
        decode: Decode,
        prompt: Sequence[int],
        max_new_tokens: int = 256,
        sampling: Sampling = GREEDY,
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        generator: torch.Generator | None = None,
    ) -> Result:
        """Continue `prompt` (token ids), `decode` taking over after the first token;
        cached KV of a shared prefix is reused."""
        prompt = self.check_prompt(prompt)
        start = time.perf_counter()
        n = len(prompt)
        stopper = Stopper(self.tokenizer, self.eos_ids, max_new_tokens, stop_strings, on_text, n)
        with device_guard(self.model.device):  # Triton launches go to the current device
            self.reserve(n + max_new_tokens + self.margin)
            reuse = reusable(self.last, prompt, drafted=bool(self.aux_ids))
            self.last = None  # until the call ends: an interrupted one leaves nothing reusable
            state = Generation(prompt, n, reuse, target_len=n)
            logits, aux = self.prefill(state)
            state = extend(state, [int(choose(logits, sampling, generator))], stopper)
            if not state.stop_reason:
                state = decode(state, aux, stopper, sampling, generator)
            self.last = state
            seconds = time.perf_counter() - start
        return Result(
            state.reply, stopper.text, state.stop_reason, n, reuse, seconds, list(state.accepted)
        )


class BaselineDecoder:
    """Plain autoregressive decoding in our runtime: one target forward per token."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        max_seq_len: int | None = None,
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ):
        # the target's decode steps: `model` or `compiled(model)`; prompts run through
        # `model` (their lengths vary, compiling each costs more)
        self.forward = forward or model
        # compiled, a lone token runs as a pair
        self.session = Session.open(model, tokenizer, max_seq_len, 1 if forward is None else 2)
        # continue a prompt (token ids): the session's call, a forward per token after the first
        self.generate = functools.partial(self.session.generate, self._decode)

    def reset(self) -> None:
        self.session.reset()

    def _decode(self, state: Generation, aux, stopper: Stopper, sampling, generator):
        """Steps after the first token until one stops: the final state."""
        session = self.session
        while not state.stop_reason:
            if state.target_len + session.margin > session.model.cache_len:
                return out_of_context(state, stopper)
            state = self._step(state, stopper, sampling, generator)
        return state

    def _step(self, state: Generation, stopper: Stopper, sampling, generator) -> Generation:
        """One target forward over the last token, and the token it gives."""
        length = state.target_len
        pos = torch.tensor([length], device=self.session.model.device)
        logits, _ = self.forward(torch.tensor([state.seq[-1:]], device=pos.device), pos, length)
        state.accepted.append(0)
        state = replace(state, target_len=length + 1)
        return extend(state, [int(choose(logits[0, -1], sampling, generator))], stopper)


class SpeculativeDecoder:
    """Tree speculative decoding (docs/design.md 3.6), lossless, with a draft of any kind.

    A step is `_device_step` (draft a tree as the draft's kind proposes, verify it, refresh the draft over
    the accepted tokens), then the one wait on the device, for the new tokens
    and their cache slots, and the KV compaction where a slot moves. Its
    shapes are fixed by the tree (the verify forward runs `num_draft_tokens`
    rows, the refresh `depth + 1`, padded), so it can run as one compiled
    graph (`compile`: the target, the draft and the bookkeeping between them
    fuse) or, on CUDA, with the verify forward and the refresh replayed from
    CUDA graphs (`cuda_graphs`, when not compiled).
    """

    def __init__(
        self,
        model: Transformer,
        draft,
        tokenizer,
        topk: int = 4,
        depth: int = 5,
        num_draft_tokens: int = 16,
        max_seq_len: int | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
    ):
        from eagletools.draft import DraftKVCache

        check_draft_fits(model, draft)
        check_tree_shape(topk, depth, num_draft_tokens)
        self.kind = kind_of(draft.config)
        self.topk, self.depth, self.num_draft_tokens = topk, depth, num_draft_tokens
        self.session = Session.open(
            model, tokenizer, max_seq_len, num_draft_tokens + 1, tuple(draft.config.aux_layer_ids)
        )
        # continue a prompt (token ids): the session's call, speculative steps after the first
        self.generate = functools.partial(self.session.generate, self._decode)
        self.draft = pack_linears(draft.to(model.dtype).eval())
        self.draft.decode_weights()  # made eagerly: a compiled step reads them frozen
        # the draft cache's slots past the context: a tree's nodes, or a block's rows
        self.tree_slots = max(max_tree_nodes(topk, depth), self.kind.block_rows(draft.config))
        self.path_rows = min(num_draft_tokens, depth + 1)  # most nodes a path holds, root too
        self.cache = DraftKVCache.allocate(
            draft.config, 1, self.tree_slots, model.dtype, model.device
        )  # grown with the target's (`_grow_cache`)
        identity = bool((draft.d2t == 0).all())
        self.d2t = None if identity else draft.d2t
        self.compiled = compile
        self.verify_forward, self.refresh = self._verify_forward, self._refresh
        self.device_step = self._device_step
        if compile:  # one graph per tree shape and cache allocation
            self.device_step = compile_frozen(self._device_step, "L['root'],L['length']")
        elif cuda_graphs:  # on CUDA: captured once per cache allocation, then replayed
            self.verify_forward = graphed(self._verify_forward, model.device, self._caches)
            self.refresh = graphed(self._refresh, model.device, self._caches)

    @property
    def model(self) -> Transformer:
        """The target's runtime: the session's, not a second reference to keep in step."""
        return self.session.model

    def _caches(self) -> tuple[torch.Tensor, ...]:
        """What the step's calls write besides their outputs: both KV caches."""
        return self.model.kv_cache.k, self.model.kv_cache.v, self.cache.k, self.cache.v

    def reset(self) -> None:
        self.session.reset()

    def _grow_cache(self) -> None:
        """The draft's cache as long as the target's (a tree's slots beyond it)."""
        size = self.model.cache_len + self.tree_slots
        if self.cache.k.shape[-2] < size:  # a new cache: its per-layer views follow
            from eagletools.draft import DraftKVCache

            self.cache = DraftKVCache(grown(self.cache.k, size), grown(self.cache.v, size))

    def _verify_forward(self, tokens, positions, start, mask):
        """The target over the tree: (logits [1,N,V], aux [1,N,A*H])."""
        return self.model(tokens, positions, start, mask, self.session.aux_ids)

    def _refresh(
        self,
        aux: torch.Tensor,
        tokens: torch.Tensor,
        start: int | torch.Tensor,
        last_only: bool = False,
    ):
        """Draft entries `start..` from the target's aux [n, A*H] and the next tokens [n]:
        (draft logits [n, Vd], hidden [n, H]), or the last row's alone with `last_only`
        (a prompt). Causal, so rows padded after the real ones change nothing before them."""
        n = tokens.shape[0]
        slots = start + torch.arange(n, device=tokens.device)
        if isinstance(start, torch.Tensor):  # every slot, hidden after the new ones
            mask = cache_mask(start, n, self.cache.k.shape[-2])
        elif n > 64:  # a prompt: causal without a mask, through SDPA's fused kernels
            mask = None
        else:
            mask = extend_mask(start, n, device=tokens.device)
        logits, h = self.draft.refresh(
            aux[None], tokens[None], slots, self.cache, slots, mask, last_only=last_only
        )
        return logits[0], h[0]

    def _draft_step(self, base: int, j: int, tokens, hidden, rows):
        """`tree.DraftStep` over a draft cache of `base` entries."""
        k = tokens.numel()
        slots = torch.arange(base + (j - 1) * k, base + j * k, device=tokens.device)
        positions = torch.full((k,), base + j - 1, device=tokens.device)
        mask = torch.cat([rows.new_ones(k, base), rows], dim=1)
        logits, h = self.draft.decode(
            hidden[None], tokens[None], positions, self.cache, slots, mask
        )
        return logits[0], h[0]

    def _draft_block(self, base: int, tokens: torch.Tensor, hidden: torch.Tensor):
        """`Drafter.block` over a draft cache of `base` entries: n rows at slots and
        positions `base..`, each seeing the cache and the rows before it (or, for a kind
        whose blocks are not causal, all n)."""
        n = tokens.numel()
        slots = torch.arange(base, base + n, device=tokens.device)
        if self.kind.block_causal:
            mask = extend_mask(base, n, device=tokens.device)
        else:  # every row sees the whole block
            mask = torch.ones(n, base + n, dtype=torch.bool, device=tokens.device)
        hidden = None if hidden is None else hidden[None]
        logits, h = self.draft.decode(hidden, tokens[None], slots, self.cache, slots, mask)
        return logits[0], h[0]

    def _decode(self, state: Generation, aux, stopper: Stopper, sampling, generator):
        """The draft's prefill over the prompt after the reused prefix, then speculative
        steps until one stops: the final state."""
        self._grow_cache()
        reuse = state.reused
        tokens = torch.tensor(state.seq[reuse + 1 :], device=self.model.device)
        d_logits, d_hidden = self._refresh(aux[0], tokens, reuse, last_only=True)
        state = replace(
            state, draft_len=reuse + len(tokens), draft_out=(d_logits[-1], d_hidden[-1])
        )
        while not state.stop_reason:
            if state.target_len + self.num_draft_tokens > self.model.cache_len:
                return out_of_context(state, stopper)
            state = self._step(state, stopper, sampling, generator)
        return state

    def _step(self, state: Generation, stopper: Stopper, sampling: Sampling, generator):
        """One speculative step after the last token: the state with the accepted drafts
        and the bonus token, and the draft's output for the next tree.

        The host waits on the device once, for the new tokens: everything else
        is queued with shapes that do not depend on how many were accepted.
        """
        length = state.target_len
        uniforms = None
        if not sampling.greedy:
            device = state.draft_out[0].device
            uniforms = torch.rand(1, self.num_draft_tokens + 1, generator=generator, device=device)
        n_acc, new, sources, d_logits, d_hidden = self.device_step(
            state.seq[-1], *state.draft_out, length, sampling, uniforms
        )
        # the step's one wait on the device: the count, the new tokens and their slots
        n, *read = torch.cat([n_acc, new, sources[0]]).tolist()
        slots = read[self.path_rows : self.path_rows + n + 1]
        # outside the graph: inductor copied whole caches to move a few entries after
        # the forward's writes, far slower than eagerly (docs/lab.md, Part 3); a path
        # whose nodes sit in their own slots (a chain's always do) moves none
        if any(slot != length + i for i, slot in enumerate(slots)):
            self.model.kv_cache.compact(sources, length)
        state.accepted.append(n)
        state = replace(
            state, target_len=length + n + 1, draft_len=length + n + 1,
            draft_out=(d_logits, d_hidden),
        )  # fmt: skip
        return extend(state, read[: n + 1], stopper)

    def _device_step(self, root: int, d_logits, d_hidden, length: int, sampling, uniforms):
        """Draft a tree under `root`, verify it and refresh the draft over the accepted
        nodes: (drafts accepted [1], the new tokens [path_rows] padded after the bonus,
        the cache slots compaction moves [1, path_rows], the draft's logits and hidden
        at the bonus)."""
        drafter = Drafter(self.draft, functools.partial(self._draft_step, length),
                          functools.partial(self._draft_block, length), self.d2t, self.topk,
                          self.depth, self.num_draft_tokens)  # fmt: skip
        tree = self.kind.propose(drafter, root, d_logits, d_hidden)
        positions = length + tree.depths
        logits, aux = self.verify_forward(tree.tokens[None], positions, length, tree.mask)
        path, n_acc, bonus = self._verify(tree, logits[0], sampling, uniforms)
        nodes = path[0, : self.path_rows]  # root first, -1 after the last accepted
        # after node i comes node i+1's token, after the last accepted one the bonus
        new = torch.cat([tree.tokens[nodes[1:].clamp(min=0)], bonus]).scatter(0, n_acc, bonus)
        sources = torch.where(nodes >= 0, length + nodes, -1)[None]
        d_logits, d_hidden = self.refresh(aux[0, nodes.clamp(min=0)], new, length)
        d_logits, d_hidden = d_logits.index_select(0, n_acc)[0], d_hidden.index_select(0, n_acc)[0]
        return n_acc, new, sources, d_logits, d_hidden

    def _verify(self, tree, logits: torch.Tensor, sampling: Sampling, uniforms):
        tokens, parents = tree.tokens[None], tree.parents[None]
        if sampling.greedy:
            return kernels.verify_greedy(tokens, parents, argmax(logits)[None])
        return kernels.verify_sampling(tokens, parents, sampling.probs(logits)[None], uniforms)


def check_draft_fits(model: Transformer, draft) -> None:
    """A draft built for another target fails here, not with a shape error mid-decode."""
    cfg, args = draft.config, model.args
    problems = []
    if cfg.target_hidden_size != args.dim:
        problems.append(
            f"draft target_hidden_size {cfg.target_hidden_size} != target hidden_size {args.dim}"
        )
    if cfg.vocab_size != args.vocab_size:
        problems.append(f"draft vocab_size {cfg.vocab_size} != target vocab_size {args.vocab_size}")
    ids = cfg.aux_layer_ids
    if ids is None or any(not 0 <= i <= args.n_layers for i in ids):
        problems.append(f"draft aux_layer_ids {ids} do not fit a {args.n_layers}-layer target")
    if problems:
        raise UserError(
            "the draft does not fit the target: " + "; ".join(problems) + " (use a draft "
            "trained for this target, or the target this draft was trained for)"
        )
