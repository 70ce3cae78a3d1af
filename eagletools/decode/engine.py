"""Tree speculative decoding with an EAGLE-3 draft, and the plain baseline.

Both decoders run the same `Transformer` and share prefill, prefix reuse
across turns, sampling and stop handling, so their speed and outputs compare
like for like. Batch size 1.

Cache bookkeeping: `seq` holds every token of the conversation so far; the
target's KV cache holds the first `target_len` of them at slots `0..`, the
draft's cache holds entries `0..draft_len-1`, entry p made from the target's
aux states at p and the token p+1 (docs/design.md 3.5 alignment).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from eagletools import kernels
from eagletools.compiling import compile_frozen
from eagletools.cpu_ops import argmax, pack_linears
from eagletools.decode.graphs import graphed
from eagletools.decode.model import Transformer, cache_mask, extend_mask, grown
from eagletools.decode.tree import check_tree_shape, grow_tree, max_tree_nodes
from eagletools.devices import device_guard
from eagletools.errors import UserError


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise UserError(
                f"sampling: need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1, got "
                f"{self.temperature}, {self.top_k}, {self.top_p}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] -> fp32 distribution after temperature, top-k, top-p (HF order)."""
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(-1)
        if self.top_p < 1:
            probs = probs.masked_fill(probs < nucleus_floor(probs, self.top_p), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] -> [..., 1]: the least probability top-p keeps.

    In descending order a token is kept while the mass before it is at most
    `top_p`; ties of the last kept one are kept too, whatever their order.
    Tokens under (1 - top_p) / 2V hold less than 1 - top_p together, so the
    others reach past `top_p` and only they are sorted: a few hundred for a
    peaked distribution instead of the vocabulary. Should rounding leave a row
    short of `top_p`, the whole vocabulary is sorted.
    """
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    for least in ((1 - top_p) / (2 * vocab), 0.0):
        top = _descending_at_least(rows, least)
        past = top.cumsum(-1) - top > top_p  # mass before it already enough
        if least == 0 or bool(past.any(-1).all()):
            break
    # first dropped position; none (everything kept) points at the zero padding
    kept = torch.where(past.any(-1, keepdim=True), past.int().argmax(-1, keepdim=True), -1)
    return top.gather(-1, kept - (kept > 0).long()).view(*probs.shape[:-1], 1)


def _descending_at_least(rows: torch.Tensor, least: float) -> torch.Tensor:
    """[R, V] -> [R, n+1]: each row's values >= `least` in descending order, zero-padded."""
    keep = rows >= least
    counts = keep.sum(-1)
    values = rows[keep]
    row_of = torch.repeat_interleave(torch.arange(len(rows), device=rows.device), counts)
    order = values.sort(descending=True, stable=True).indices
    order = order[row_of[order].sort(stable=True).indices]  # by row, descending within
    values, row_of = values[order], row_of[order]
    column = torch.arange(len(values), device=rows.device) - (counts.cumsum(0) - counts)[row_of]
    out = rows.new_zeros(len(rows), int(counts.max()) + 1)
    out[row_of, column] = values
    return out


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


class _Text:
    """`decode(tokens)` of a growing token list, decoding a few tokens per step.

    Each step decodes a window from the start of the last complete piece (so
    a leading space or a clean-up sees its left context) and appends what the
    new tokens add; while the new tokens hold a partial multi-byte character
    the window keeps growing, so it always starts at a whole character. Where the window's text does not
    extend its context (a tokenizer whose clean-up looks further back), the
    whole text is decoded.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.done = ""  # text of tokens[: self.read]: final, whatever follows
        self.start = self.read = 0  # the window: tokens[start:], context tokens[start:read]
        self.context = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        window = self._decode(self.tokens[self.start :])
        if not window.startswith(self.context):
            self.text = self._decode(self.tokens)
            return
        self.text = self.done + window[len(self.context) :]
        # a partial character decodes as U+FFFD (or as nothing, with errors="ignore")
        if len(window) > len(self.context) and not window.endswith("\ufffd"):
            self.start, self.read, self.done = self.read, len(self.tokens), self.text
            self.context = self._decode(self.tokens[self.start :])


class _Stopper:
    """EOS, max tokens and stop strings; streams text as it becomes final.

    The text grows by `_Text`, and stop strings are searched for only where
    the new tokens could have completed one.
    """

    def __init__(self, tokenizer, eos: set[int], max_new_tokens: int, stop_strings, on_text):
        self.max_new_tokens = max_new_tokens
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.longest = max(map(len, self.stop_strings), default=0)
        self.eos = eos
        self.on_text = on_text
        self.tokens: list[int] = []
        self.decoded = _Text(tokenizer) if tokenizer is not None else None
        self.text = ""
        self.streamed = 0  # characters of `text` given to on_text
        self.reason = ""

    def give_up(self, reason: str) -> None:
        """Stop for a reason of the decoder's own (the context is full)."""
        self.reason = reason
        self._emit(final=True)

    def add(self, new_tokens: Sequence[int]) -> bool:
        """Append tokens; True once generation must stop (at a stop string, cut there)."""
        for tok in new_tokens:
            self.tokens.append(tok)
            if self.decoded is not None:
                final_before = len(self.decoded.done)
                self.decoded.append(tok)
            if tok in self.eos:
                self.reason = "eos"
            elif len(self.tokens) >= self.max_new_tokens:
                self.reason = "max_tokens"
            elif self.stop_strings:
                tail = self.decoded.text[max(0, final_before - self.longest + 1) :]
                if any(s in tail for s in self.stop_strings):
                    self.reason = "stop_string"
            if self.reason:
                break
        self._emit(final=bool(self.reason))
        return bool(self.reason)

    def _emit(self, final: bool) -> None:
        if self.decoded is None:
            return
        text = self.decoded.text
        if final and self.reason == "stop_string":
            text = text[: min(text.find(s) for s in self.stop_strings if s in text)]
        self.text = text
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
            if self.stop_strings:  # hold back what could begin a stop string
                text = text[: len(text) - self.longest + 1]
        if (
            self.on_text
            and len(text) > self.streamed
            and text.startswith(self.text[: self.streamed])
        ):
            self.on_text(text[self.streamed :])
            self.streamed = len(text)


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def eos_token_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS plus the end-of-turn tokens chat templates close replies with."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[name] for name in END_OF_TURN if name in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class BaselineDecoder:
    """Plain autoregressive decoding in our runtime: one target forward per token."""

    margin = 1  # cache slots a step needs beyond the sequence
    aux_ids: tuple[int, ...] = ()  # target hidden states the prefill must also return

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        max_seq_len: int | None = None,
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ):
        self.model = model
        # the target's decode steps and tree verification: `model` or `compiled(model)`;
        # prompts run through `model` (their lengths vary, compiling each costs more)
        self.forward = forward or model
        if forward is not None:  # compiled, a lone token runs as a pair of rows
            self.margin = max(self.margin, 2)
        self.tokenizer = tokenizer  # None: token ids only, no text
        self.eos_ids = eos_token_ids(tokenizer) if tokenizer is not None else set()
        context = model.args.max_seq_len
        self.max_seq_len = min(max_seq_len or context, context)  # the cache never outgrows it
        self.seq: list[int] = []
        self.target_len = 0

    def reset(self) -> None:
        """Forget the cached conversation (the next prompt is prefilled from scratch)."""
        self.seq, self.target_len = [], 0

    def _common_prefix(self, prompt: list[int]) -> int:
        common = 0
        for a, b in zip(self.seq, prompt, strict=False):
            if a != b:
                break
            common += 1
        return common

    def _reserve(self, length: int) -> None:
        """The runtime's KV cache for this decoder, `length` slots at least.

        It holds what this run needs (prompt + new tokens + a tree), not the
        whole context, and grows as a conversation does (`Transformer.reserve`).
        """
        self.model.reserve(length, self.max_seq_len)
        if self.model.cache_owner is not self:  # new, or another decoder or a batch wrote it
            self.reset()
            self.model.cache_owner = self

    def _reusable(self, prompt: list[int]) -> int:
        """Prompt tokens whose cached KV stays valid (one at least is run again)."""
        return min(self._common_prefix(prompt), self.target_len, len(prompt) - 1)

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
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

    def _choose(self, logits: torch.Tensor, sampling: Sampling, generator) -> int:
        if sampling.greedy:
            return int(argmax(logits))
        return int(torch.multinomial(sampling.probs(logits), 1, generator=generator))

    def _prefill(self, prompt: list[int], reuse: int):
        """Run the prompt after the reused prefix: (last logits [V], aux [1,T,A*H] or None)."""
        model = self.model
        ids = torch.tensor([prompt[reuse:]], device=model.device)
        positions = torch.arange(reuse, len(prompt), device=model.device)
        logits, aux = model(ids, positions, reuse, aux_layer_ids=self.aux_ids, last_only=True)
        self.seq, self.target_len = list(prompt), len(prompt)
        return logits[0, -1], aux

    @torch.inference_mode()
    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int = 256,
        sampling: Sampling = Sampling(),
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        generator: torch.Generator | None = None,
    ) -> Result:
        """Continue `prompt` (token ids); cached KV of a shared prefix is reused."""
        prompt = self._check_prompt(prompt)
        start = time.perf_counter()
        with device_guard(self.model.device):  # Triton launches go to the current device
            self._reserve(len(prompt) + max_new_tokens + self.margin)
            reuse = self._reusable(prompt)
            logits, aux = self._prefill(prompt, reuse)
            stop = _Stopper(self.tokenizer, self.eos_ids, max_new_tokens, stop_strings, on_text)
            token = self._choose(logits, sampling, generator)
            self.seq.append(token)
            accepted = []
            if not stop.add([token]):
                self._decode(token, aux, reuse, stop, accepted, sampling, generator)
            seconds = time.perf_counter() - start
        return Result(stop.tokens, stop.text, stop.reason, len(prompt), reuse, seconds, accepted)

    def _decode(self, token, aux, reuse, stop, accepted, sampling, generator) -> None:
        """Generate after the first token until `stop` says so; one entry per step in `accepted`."""
        while True:
            if self.target_len + self.margin > self.model.cache_len:
                return stop.give_up("context")
            pos = torch.tensor([self.target_len], device=self.model.device)
            logits, _ = self.forward(
                torch.tensor([[token]], device=pos.device), pos, self.target_len
            )
            self.target_len += 1
            accepted.append(0)
            token = self._choose(logits[0, -1], sampling, generator)
            self.seq.append(token)
            if stop.add([token]):
                return


class SpeculativeDecoder(BaselineDecoder):
    """EAGLE-3 tree speculative decoding (docs/design.md 3.6), lossless.

    A step is `_device_step` (draft a tree, verify it, refresh the draft over
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
        self.topk, self.depth, self.num_draft_tokens = topk, depth, num_draft_tokens
        self.margin = num_draft_tokens + 1
        super().__init__(model, tokenizer, max_seq_len)
        self.draft = pack_linears(draft.to(model.dtype).eval())
        self.draft.decode_weights()  # made eagerly: a compiled step reads them frozen
        self.aux_ids = tuple(draft.config.aux_layer_ids)
        self.tree_slots = max_tree_nodes(topk, depth)
        self.path_rows = min(num_draft_tokens, depth + 1)  # most nodes a path holds, root too
        self.cache = DraftKVCache.allocate(
            draft.config, 1, self.tree_slots, model.dtype, model.device
        )  # grown with the target's (`_reserve`)
        identity = bool((draft.d2t == 0).all())
        self.d2t = None if identity else draft.d2t
        self.draft_len = 0
        self.compiled = compile
        self.verify_forward, self.refresh = self._verify_forward, self._refresh
        self.device_step = self._device_step
        if compile:  # one graph per tree shape and cache allocation
            self.device_step = compile_frozen(self._device_step, "L['root'],L['length']")
        elif cuda_graphs:  # on CUDA: captured once per cache allocation, then replayed
            self.verify_forward = graphed(self._verify_forward, model.device, self._caches)
            self.refresh = graphed(self._refresh, model.device, self._caches)

    def _caches(self) -> tuple[torch.Tensor, ...]:
        """What the step's calls write besides their outputs: both KV caches."""
        return self.model.kv_cache.k, self.model.kv_cache.v, self.cache.k, self.cache.v

    def reset(self) -> None:
        super().reset()
        self.draft_len = 0

    def _reserve(self, length: int) -> None:
        super()._reserve(length)
        size = self.model.cache_len + self.tree_slots
        if self.cache.k.shape[2] < size:
            self.cache.k, self.cache.v = grown(self.cache.k, size), grown(self.cache.v, size)

    def _reusable(self, prompt: list[int]) -> int:
        # draft entry p also needs token p+1 to match
        reuse = super()._reusable(prompt)
        return max(0, min(reuse, self._common_prefix(prompt) - 1, self.draft_len))

    def _verify_forward(self, tokens, positions, start, mask):
        """The target over the tree: (logits [1,N,V], aux [1,N,A*H])."""
        return self.model(tokens, positions, start, mask, self.aux_ids)

    def _refresh(self, aux: torch.Tensor, tokens: torch.Tensor, start: int | torch.Tensor):
        """Draft entries `start..` from the target's aux [n, A*H] and the next tokens [n]:
        (draft logits [n, Vd], hidden [n, H]). Causal, so rows padded after the real
        ones change nothing before them."""
        n = tokens.shape[0]
        hidden = self.draft.fuse_aux(aux)[None]
        slots = start + torch.arange(n, device=tokens.device)
        if isinstance(start, torch.Tensor):  # every slot, hidden after the new ones
            mask = cache_mask(start, n, self.cache.k.shape[2])
        elif n > 64:  # a prompt: causal without a mask, through SDPA's fused kernels
            mask = None
        else:
            mask = extend_mask(start, n, device=tokens.device)
        logits, h = self.draft.decode(hidden, tokens[None], slots, self.cache, slots, mask)
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

    def _decode(self, root, aux, reuse, stop, accepted, sampling, generator) -> None:
        model = self.model
        tokens = torch.tensor(self.seq[reuse + 1 :], device=model.device)
        d_logits, d_hidden = self._refresh(aux[0], tokens, reuse)
        d_logits, d_hidden = d_logits[-1], d_hidden[-1]
        self.draft_len = reuse + len(tokens)
        while True:
            length = self.target_len
            if length + self.num_draft_tokens > model.cache_len:
                return stop.give_up("context")
            new, d_logits, d_hidden = self._step(root, d_logits, d_hidden, sampling, generator)
            self.seq.extend(new)
            self.target_len = self.draft_len = length + len(new)
            accepted.append(len(new) - 1)
            root = new[-1]
            if stop.add(new):
                return

    def _step(self, root: int, d_logits, d_hidden, sampling: Sampling, generator):
        """One speculative step after `root`, the last token: (new tokens: the accepted
        drafts and the bonus, the draft's logits and hidden for the next tree).

        The host waits on the device once, for the new tokens: everything else
        is queued with shapes that do not depend on how many were accepted.
        """
        length = self.target_len
        uniforms = None
        if not sampling.greedy:
            device = d_logits.device
            uniforms = torch.rand(1, self.num_draft_tokens + 1, generator=generator, device=device)
        n_acc, new, sources, d_logits, d_hidden = self.device_step(
            root, d_logits, d_hidden, length, sampling, uniforms
        )
        # the step's one wait on the device: the count, the new tokens and their slots
        n, *read = torch.cat([n_acc, new, sources[0]]).tolist()
        slots = read[self.path_rows : self.path_rows + n + 1]
        # outside the graph: inductor copied whole caches to move a few entries after
        # the forward's writes, far slower than eagerly (docs/lab.md, Part 3); a path
        # whose nodes sit in their own slots (a chain's always do) moves none
        if any(slot != length + i for i, slot in enumerate(slots)):
            self.model.kv_cache.compact(sources, length)
        return read[: n + 1], d_logits, d_hidden

    def _device_step(self, root: int, d_logits, d_hidden, length: int, sampling, uniforms):
        """Draft a tree under `root`, verify it and refresh the draft over the accepted
        nodes: (drafts accepted [1], the new tokens [path_rows] padded after the bonus,
        the cache slots compaction moves [1, path_rows], the draft's logits and hidden
        at the bonus)."""
        tree = grow_tree(
            functools.partial(self._draft_step, length),
            root,
            d_logits,
            d_hidden,
            self.d2t,
            self.topk,
            self.depth,
            self.num_draft_tokens,
        )
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
