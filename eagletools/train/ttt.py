"""Training-time test (docs/design.md 3.5): the K-step unroll, its loss and metrics.

At step j the query at position t (embedding of token t+1+j, RoPE position
t+j) attends causally over the step-0 keys and, at its own position only,
over the keys of steps 1..j. The causal block is computed in query chunks
under activation checkpointing and the diagonal as per-position dot products,
both inside one softmax, so no [T, T*j] score tensor is ever kept alive:
memory per step is linear in T.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagletools.cpu_ops import argmax
from eagletools.train.packing import document_mask, document_positions, within_document


def _attend_chunk(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    start: int,
    scale: float,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B,kv,g,C,hd] at positions start.., k0/v0 [B,kv,S,hd] (S = start+C),
    dk/dv [B,kv,C,j,hd], documents [B,S] (packed rows) -> [B,kv,g,C,hd]."""
    c, s = q.shape[-2], k0.shape[-2]
    scores = torch.matmul(q, k0.unsqueeze(2).transpose(-1, -2)) * scale  # [B,kv,g,C,S]
    if documents is None:
        rows = torch.arange(start, start + c, device=q.device).unsqueeze(-1)
        allowed = torch.arange(s, device=q.device) <= rows
    else:
        allowed = document_mask(documents, start)[:, None, None]  # [B,1,1,C,S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if dk is not None:
        diag = torch.einsum("bkgcd,bkcjd->bkgcj", q, dk) * scale
        scores = torch.cat([scores, diag], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(v0.dtype)
    out = torch.matmul(probs[..., :s], v0.unsqueeze(2))
    if dv is not None:
        out = out + torch.einsum("bkgcj,bkcjd->bkgcd", probs[..., s:], dv)
    return out


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    chunk: int = 512,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B,nh,T,hd]; k0, v0 and each diag_k/diag_v [B,nkv,T,hd] -> [B,nh,T,hd].

    `documents` [B,T] (packed rows): the step-0 keys are seen within a query's own
    conversation only; the diagonal is the query's own position, so always is."""
    b, nh, t, hd = q.shape
    nkv = k0.shape[1]
    qg = q.view(b, nkv, nh // nkv, t, hd)
    dk = torch.stack(diag_k, dim=3) if diag_k else None  # [B,kv,T,j,hd]
    dv = torch.stack(diag_v, dim=3) if diag_v else None
    outs = []
    # one chunk needs no loop over t, which would fix a compiled graph to one length
    for start in [0] if t <= chunk else range(0, t, chunk):
        end = min(start + chunk, t)
        args = (
            qg[..., start:end, :],
            k0[:, :, :end],
            v0[:, :, :end],
            None if dk is None else dk[:, :, start:end],
            None if dv is None else dv[:, :, start:end],
            start,
            hd**-0.5,
            None if documents is None else documents[:, :end],
        )
        if torch.is_grad_enabled():
            outs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outs.append(_attend_chunk(*args))
    return torch.cat(outs, dim=-2).reshape(b, nh, t, hd)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] right-padded with zeros back to length T (dim 1)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


@torch.no_grad()
def target_argmax(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk_tokens: int = 1024
) -> torch.Tensor:
    """The target's full-vocab argmax of hidden [N,Ht] -> [N], a chunk of rows at a
    time, so no [N, V] tensor is kept."""
    hidden = hidden.to(lm_head_weight.dtype)
    return torch.cat([argmax(part @ lm_head_weight.T) for part in hidden.split(chunk_tokens)])


@torch.no_grad()
def teacher_targets(
    last_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    d2t: torch.Tensor,
    chunk_tokens: int = 1024,
    known_argmax: torch.Tensor | None = None,
    full_argmax: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocab and its full-vocab argmax.

    last_hidden [B,T,Ht] (after the final norm), lm_head_weight [V,Ht], d2t [Vd]
    -> (probs [B,T,Vd] fp32, renormalised over the draft vocab; argmax [B,T]).
    Only the draft-vocab rows get softmaxed; the full product is formed chunk
    by chunk just for the argmax, so no [T, V] tensor is kept. `known_argmax`
    (an offline epoch's memo) skips that product, the larger of the two, and so
    does `full_argmax=False`, which returns the argmax over the draft vocab (as
    target ids): all a loss needs that trains every position.
    """
    rows = torch.arange(d2t.numel(), device=d2t.device) + d2t
    flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(lm_head_weight.dtype)
    # one [N, Vd] fp32 tensor (4 GB at 32k tokens x 32k draft ids), softmaxed in place a
    # chunk of rows at a time (torch's own kernel, so a row's probabilities do not depend
    # on how many rows share the call)
    probs = (flat @ lm_head_weight[rows].T).float()
    for part in probs.split(chunk_tokens):
        part.copy_(torch.softmax(part, dim=-1))
    b, t = last_hidden.shape[:2]
    if known_argmax is not None:
        best = known_argmax.reshape(-1)
    elif not full_argmax:
        best = rows[argmax(probs)]
    else:
        best = target_argmax(flat, lm_head_weight, chunk_tokens)
    return probs.view(b, t, -1), best.view(b, t)


@dataclass
class StepStats:
    """Per-sample sums over masked positions; the caller reduces them across batches.

    Kept per sample (rows) so that held-out metrics get a bootstrap interval over
    conversations; training sums the rows away at once.
    """

    loss_sum: torch.Tensor  # [N,K] soft cross-entropy summed over masked positions
    correct: torch.Tensor  # [N,K] positions where the draft's argmax is the target's
    count: torch.Tensor  # [N,K] masked positions
    chain: torch.Tensor  # [N] exact chain lengths summed over the step-0 positions

    @classmethod
    def of(
        cls, sums: list[torch.Tensor], hits: list[torch.Tensor], masks: list[torch.Tensor]
    ) -> StepStats:
        """Per depth j: the rows' loss sums [B] and the hits and masks [B,T]."""
        stack = functools.partial(torch.stack, dim=1)
        correct = stack([(h * m).sum(-1) for h, m in zip(hits, masks, strict=True)])
        count = stack([m.sum(-1) for m in masks])
        return cls(stack(sums), correct, count, chain_lengths(hits, masks))

    @classmethod
    def zeros(cls, rows: int, steps: int, device: torch.device | str = "cpu") -> StepStats:
        return cls(*(torch.zeros(rows, steps, device=device) for _ in range(3)),
                   torch.zeros(rows, device=device))  # fmt: skip

    def map(self, fn) -> StepStats:
        """The same stats with `fn` applied to every field (sum, reduce, index)."""
        return StepStats(*(fn(getattr(self, f.name)) for f in dataclasses.fields(self)))

    def add_(self, other: StepStats, rows: torch.Tensor | slice = slice(None)) -> None:
        """Add `other` (summed over its rows, or row by row into `rows`) in place."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(rows, slice):
                mine.add_(theirs.sum(0))
            else:
                mine.index_add_(0, rows, theirs)


def chain_lengths(hits: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    """Exact chain lengths summed per row: hits and masks per step j, each [B,T].

    A chain rooted at position t (a step-0 position) accepts its step-j token while
    every step up to j hit: 1 + sum_k prod_{j<=k} hit_j(t) mask_j(t). Unlike
    `simulated_acceptance_length`, which multiplies per-step marginal accuracies,
    this keeps which positions hit together. A chain stops where its mask ends.
    """
    run = masks[0].float()
    total = run.clone()
    for hit, mask in zip(hits, masks, strict=True):
        run = run * hit.float() * mask.float()
        total = total + run
    return total.sum(-1)


def step_mask(
    loss_mask: torch.Tensor, j: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """[B,T] positions step j is taught at: loss_mask[t+2+j], cut where t+2+j lies in
    another conversation of a packed row."""
    mask = _shift(loss_mask, 2 + j)
    return mask if documents is None else mask * within_document(documents, 2 + j)


def step_counts(
    loss_mask: torch.Tensor, steps: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Masked positions per step [K]: step j predicts the token at t+2+j."""
    return torch.stack([step_mask(loss_mask, j, documents).sum() for j in range(steps)]).float()


@dataclass(frozen=True)
class DepthTargets:
    """What a draft's proposal at depth j (0-based) is taught: at position t, the token
    t+2+j, with the target's distribution at t+1+j as teacher. The unroll's step j and a
    block's slot j+1 share it (`train.block`)."""

    teacher_probs: torch.Tensor  # [B,T,Vd]
    target_argmax: torch.Tensor  # [B,T]
    loss_mask: torch.Tensor  # [B,T]
    documents: torch.Tensor | None  # [B,T], packed rows
    train_oov: bool  # also positions whose target token is outside the draft vocab

    def terms(
        self, draft: nn.Module, logits: torch.Tensor, j: int, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Depth j's draft logits [B,T,Vd] -> (soft cross-entropy summed per row [B],
        hits [B,T] (argmax is the target's), taught positions [B,T]); with `rows` [B,M]
        the logits [B,M,Vd] are at those positions only, and so are hits and masks."""
        if rows is None:
            probs = _shift(self.teacher_probs, 1 + j)
            wanted = _shift(self.target_argmax, 1 + j)
            mask = step_mask(self.loss_mask, j, self.documents).float()
        else:
            t = self.loss_mask.shape[1]
            at = (rows + 1 + j).clamp(max=t - 1)
            probs = self.teacher_probs.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
            wanted = self.target_argmax.gather(1, at)
            mask = step_mask(self.loss_mask, j, self.documents).float().gather(1, rows)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logp).sum(-1)
        in_vocab = 1.0 if self.train_oov else draft.t2d[wanted]
        row_sums = (ce * mask * in_vocab).sum(-1)
        with torch.no_grad():
            hit = (draft.to_target_ids(argmax(logp)) == wanted).float()
        return row_sums, hit, mask


class DepthLosses:
    """A forward's loss and stats, depth by depth: depth j's loss, summed under its mask
    and divided by `norm[j]` (the trainer's global count; default the local one), is
    weighted by `decay**j`."""

    def __init__(self, targets: DepthTargets, decay: float, norm: torch.Tensor | None):
        self.targets, self.decay, self.norm = targets, decay, norm
        self.loss = torch.zeros((), dtype=torch.float32)
        self.sums: list[torch.Tensor] = []
        self.hits: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def add(self, draft: nn.Module, logits: torch.Tensor, rows: torch.Tensor | None = None,
            scale: torch.Tensor | None = None) -> None:  # fmt: skip
        """The next depth's logits (at `rows`, see `DepthTargets.terms`), each row's loss
        times `scale` [B] if given."""
        j = len(self.sums)
        row_sums, hit, mask = self.targets.terms(draft, logits, j, rows)
        denom = (self.norm[j] if self.norm is not None else mask.sum()).clamp(min=1.0)
        weighted = row_sums if scale is None else row_sums * scale
        self.loss = self.loss.to(logits.device) + self.decay**j * weighted.sum() / denom
        self.sums.append(row_sums.detach())
        self.hits.append(hit)
        self.masks.append(mask)

    def result(self, steps: int | None = None) -> tuple[torch.Tensor, StepStats]:
        """(loss, stats) for `steps` depths: those past the ones added count nothing."""
        steps = steps or len(self.sums)
        pad = [torch.zeros_like(x[0]) for x in (self.sums, self.hits, self.masks)]
        sums, hits, masks = ((x + [p] * steps)[:steps] for x, p in
                             zip((self.sums, self.hits, self.masks), pad, strict=True))  # fmt: skip
        return self.loss, StepStats.of(sums, hits, masks)


class DepthObjective(nn.Module):
    """What the trainer optimises, any kind: a draft wrapped so that DDP/FSDP see its
    whole objective as one `forward`, which `add_depths` fills depth by depth.

    `train_oov`: also train the positions whose target argmax is outside the draft
    vocab; the draft can never be accepted there, but its teacher, the target's
    distribution over the draft vocab, still shapes the shared features.
    """

    draft: nn.Module
    decay: float
    train_oov: bool

    def add_depths(
        self, losses: DepthLosses, input_ids: torch.Tensor, aux: torch.Tensor, steps: int | None
    ) -> None:
        """Run the draft and `losses.add` each depth's logits (`losses.targets` holds the
        batch's loss mask and documents)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        loss_mask: torch.Tensor,
        teacher_probs: torch.Tensor,
        target_argmax: torch.Tensor,
        norm: torch.Tensor | None = None,
        steps: int | None = None,
        train_oov: bool | None = None,
        documents: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, StepStats]:
        """Right-padded batch [B,T] -> (loss, per-row stats for `steps` depths).

        loss = sum_j decay^j * loss_sum_j / norm_j; `norm` [K] defaults to the
        local masked counts. The trainer passes global counts (over ranks and
        accumulation steps) so any split of a batch gives the same gradient.
        `steps` and `train_oov` override the model's (held-out evaluation).
        `documents` [B,T] marks packed rows' conversations (`train.packing`): each is
        trained as if alone in its row.
        """
        oov = self.train_oov if train_oov is None else train_oov
        targets = DepthTargets(teacher_probs, target_argmax, loss_mask, documents, oov)
        losses = DepthLosses(targets, self.decay, norm)
        self.add_depths(losses, input_ids, aux, steps)
        return losses.result(steps)


class TTTModel(DepthObjective):
    """EAGLE-3's objective: the training-time-test unroll, `steps` deep."""

    def __init__(
        self,
        draft: nn.Module,
        steps: int = 7,
        decay: float = 0.8,
        chunk: int = 512,
        train_oov: bool = False,
    ):
        super().__init__()
        self.draft, self.steps, self.decay, self.chunk = draft, steps, decay, chunk
        self.train_oov = train_oov

    def register_fsdp_methods(self) -> None:
        """FSDP2 gathers a sharded module's weights around its `forward` only, but the unroll
        calls the draft's and its layer's other methods; under an auto-wrap policy (the
        recipes' accelerate-fsdp.yaml) those would see shards. No-op without FSDP2."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        layers = self.draft.draft_layers()
        for module, names in ((self.draft, ("fuse_aux", "head")),
                              *((layer, ("qkv", "finish")) for layer in layers)):  # fmt: skip
            for name in names:
                register_fsdp_forward_method(module, name)

    def step_inputs(
        self, j: int, input_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step j's token embeddings and hidden [B,T,H] from the input ids [B,T] and the
        hidden step j-1 handed on (at step 0 the fused aux states): EAGLE-3 feeds each
        step the next token and the previous step's output."""
        embeds = self.draft.embed_tokens(_shift(input_ids, 1 + j)).to(hidden.dtype)
        return embeds, hidden

    def add_depths(
        self, losses: DepthLosses, input_ids: torch.Tensor, aux: torch.Tensor, steps: int | None
    ) -> None:
        """The unroll: step j's logits are depth j's."""
        draft, documents = self.draft, losses.targets.documents
        t = input_ids.shape[1]
        hidden = draft.fuse_aux(aux.to(draft.fc.weight.dtype))
        if documents is None:
            positions = torch.arange(t, device=input_ids.device)
        else:
            positions = document_positions(documents)
        layers = draft.draft_layers()
        keys: list[list[torch.Tensor]] = [[] for _ in layers]  # per layer: step 0's, diagonals
        values: list[list[torch.Tensor]] = [[] for _ in layers]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys[i].append(k)
            values[i].append(v)
            ks, vs = keys[i], values[i]
            return ttt_attention(q, ks[0], vs[0], ks[1:], vs[1:], self.chunk, documents)

        for j in range(steps or self.steps):
            embeds, hidden = self.step_inputs(j, input_ids, hidden)
            cos, sin = draft.rope(positions + j, hidden.dtype)
            q, k, v, residual = draft.midlayer.qkv(embeds, hidden, cos, sin)
            out = draft.midlayer.finish(attend(0, q, k, v), residual)
            for i, layer in enumerate(layers[1:], 1):
                q, k, v, residual = layer.qkv(out, cos, sin)
                out = layer.finish(attend(i, q, k, v), residual)
            logits, hidden = draft.head(out)
            losses.add(draft, logits)


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + sum_j prod_{i<=j} acc_i: the expected accepted length of a chain draft."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def summarize(stats: StepStats, decay: float) -> dict[str, float]:
    """Per-sample (or reduced) sums -> loss, per-step ploss_j / acc_j, the simulated
    acceptance length and the exact one."""
    total = stats.map(lambda x: x.sum(0) if x.dim() == 2 else x)  # [N,K] -> [K]
    count = total.count.clamp(min=1.0)
    ploss = (total.loss_sum / count).tolist()
    acc = (total.correct / count).tolist()
    out = {"loss": sum(decay**j * p for j, p in enumerate(ploss))}
    out.update({f"ploss_{j}": p for j, p in enumerate(ploss)})
    out.update({f"acc_{j}": a for j, a in enumerate(acc)})
    out["simulated_acceptance_length"] = simulated_acceptance_length(acc)
    out["exact_acceptance_length"] = float(total.chain.sum() / count[0])
    return out
