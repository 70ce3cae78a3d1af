"""DFlash's objective: blocks anchored across each row, each filled in one forward
(docs/design.md 3.7).

The block anchored after position t holds the token t+1 (slot 0, the bonus token
at decode time) and K mask tokens (slots 1..K) at positions t+1..t+1+K. Every
slot attends over the context (the target's states at positions 0..t, through
each layer's K/V of c, within its own conversation in a packed row) and over
every slot of its own block. Slot j+1 is taught what depth j of every kind is
taught (`train.ttt.DepthTargets`: the token t+2+j), so the held-out metrics and
simulated acceptance lengths compare with EAGLE-3's and P-EAGLE's as they are.

A training step anchors blocks at a random `anchor_share` of the positions whose
block has something to learn (speculators: up to 512 per 8,192-token row), each
row's loss scaled back to what all of them would give; the held-out pass anchors
at every position. Attention runs a chunk of anchors at a time under activation
checkpointing, so memory stays linear in the sequence.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagletools.train.packing import document_positions
from eagletools.train.ttt import DepthLosses, DepthObjective, step_mask


class BlockModel(DepthObjective):
    """DFlash's objective over a `DFlashDraft`: slot j+1 of every block is depth j."""

    def __init__(self, draft: nn.Module, decay: float = 0.8, chunk: int = 512,
                 train_oov: bool = False, anchor_share: float = 1.0):  # fmt: skip
        super().__init__()
        self.draft, self.decay, self.chunk, self.train_oov = draft, decay, chunk, train_oov
        self.anchor_share = anchor_share
        self.steps = draft.config.block_size - 1

    def register_fsdp_methods(self) -> None:
        """FSDP2 gathers a module's weights around its `forward` only (`TTTModel`)."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        for name in ("fuse_aux", "context_kv"):
            register_fsdp_forward_method(self.draft, name)
        for layer in self.draft.draft_layers():
            for name in ("qkv", "finish"):
                register_fsdp_forward_method(layer, name)

    def block_states(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        documents: torch.Tensor | None,
        anchors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The blocks anchored after `anchors` [B,M] (default: every position), their
        output after the final norm [B,M,K+1,H]."""
        draft = self.draft
        b, t = input_ids.shape
        s = self.steps + 1
        if anchors is None:
            anchors = torch.arange(t, device=aux.device).expand(b, t)
        context = draft.fuse_aux(aux.to(draft.fc.weight.dtype))
        positions = torch.arange(t, device=aux.device).expand(b, t) if documents is None else (
            document_positions(documents))  # fmt: skip
        slots = torch.arange(1, s + 1, device=aux.device)
        cos, sin = draft.rope(positions, context.dtype)  # the context's
        block_positions = positions.gather(1, anchors)[..., None] + slots
        bcos, bsin = draft.rope(block_positions.flatten(1), context.dtype)
        ids = draft.block_ids(0, s).expand(*anchors.shape, s).clone()
        ids[..., 0] = input_ids.gather(1, (anchors + 1).clamp(max=t - 1))
        x = draft.embed_tokens(ids).to(context.dtype).flatten(1, 2)  # [B, M*S, H]
        for layer in draft.draft_layers():
            kc, vc = draft.context_kv(layer, context, cos, sin)
            q, k, v, residual = layer.qkv(x, bcos, bsin)
            out = anchored_attention(q, k, v, kc, vc, anchors, s, self.chunk, documents)
            x = layer.finish(out, residual)
        return draft.norm(x).view(*anchors.shape, s, -1)

    def sample_anchors(
        self, loss_mask: torch.Tensor, documents: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`anchor_share` of the positions, drawn per row among those whose first
        proposal is taught -> (anchors [B,M] sorted, each row's weight [B]: its taught
        positions over those drawn, so the loss sums to what every anchor would give)."""
        b, t = loss_mask.shape
        m = max(1, min(t, round(self.anchor_share * t)))
        taught = step_mask(loss_mask, 0, documents).float()
        weights = taught + 1e-6  # rows with fewer taught positions than m draw others too
        anchors = torch.multinomial(weights, m).sort(-1).values
        drawn = taught.gather(1, anchors).sum(-1)
        return anchors, taught.sum(-1) / drawn.clamp(min=1.0)

    def add_depths(
        self, losses: DepthLosses, input_ids: torch.Tensor, aux: torch.Tensor, steps: int | None
    ) -> None:
        """Every block of the draft's size whatever `steps` asks (a shorter one computes
        another draft: its slots see each other); a training step's anchors are drawn
        (`sample_anchors`), the held-out pass's are every position."""
        anchors, scale, documents = None, None, losses.targets.documents
        if self.training and self.anchor_share < 1:
            anchors, scale = self.sample_anchors(losses.targets.loss_mask, documents)
        states = self.block_states(input_ids, aux, documents, anchors)
        for j in range(self.steps):
            losses.add(self.draft, self.draft.lm_head(states[:, :, j + 1]), anchors, scale)


def anchored_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    anchors: torch.Tensor,
    slots: int,
    chunk: int,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """Blocks of `slots` rows: q [B,nh,M*S,hd] and k, v [B,nkv,M*S,hd] (block m's rows
    together), the context's context_k/v [B,nkv,T,hd], anchors [B,M] -> [B,nh,M*S,hd].
    Block m sees the context up to anchors[m] in its conversation and all of itself;
    `chunk` query rows at a time."""
    b, nh, rows, hd = q.shape
    nkv, m = context_k.shape[1], anchors.shape[1]
    qg = q.view(b, nkv, nh // nkv, m, slots, hd)
    own_k, own_v = (x.view(b, nkv, m, slots, hd) for x in (k, v))
    step = max(1, chunk // slots)
    # keys past a chunk's last anchor are masked anyway: not scored (anchors are sorted).
    # That halves the scores a row computes on average, not the peak: at 32k tokens and
    # 32 heads a chunk of 512 rows anchored near the end still scores 2 GiB in fp32.
    # Every chunk's end is read in one host sync, not one per chunk (a GPU stall each)
    last = torch.arange(step - 1, m + step - 1, step, device=anchors.device).clamp(max=m - 1)
    ends = (anchors[:, last].amax(0) + 1).tolist()
    outs = []
    for start, end in zip(range(0, m, step), ends, strict=True):
        part = slice(start, start + step)
        docs = None if documents is None else documents[:, :end]
        args = (qg[:, :, :, part], context_k[:, :, :end], context_v[:, :, :end],
                own_k[:, :, part], own_v[:, :, part], anchors[:, part], docs)  # fmt: skip
        if torch.is_grad_enabled():
            outs.append(checkpoint(_anchored_chunk, *args, use_reentrant=False))
        else:
            outs.append(_anchored_chunk(*args))
    return torch.cat(outs, dim=3).reshape(b, nh, rows, hd)


def _anchored_chunk(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    anchors: torch.Tensor,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """q [B,kv,g,C,S,hd], context_k/v [B,kv,T,hd], k/v [B,kv,C,S,hd], anchors [B,C]
    -> [B,kv,g,C,S,hd]."""
    b, kv, g, c, s, hd = q.shape
    t = context_k.shape[2]
    scale = hd**-0.5
    flat = q.reshape(b, kv, g, c * s, hd)
    seen = torch.matmul(flat, context_k.unsqueeze(2).transpose(-1, -2)).view(b, kv, g, c, s, t)
    allowed = torch.arange(t, device=q.device) <= anchors[..., None]  # [B,C,T]
    if documents is not None:
        allowed = allowed & (documents[:, None, :] == documents.gather(1, anchors)[..., None])
    seen = seen.masked_fill(~allowed[:, None, None, :, None, :], float("-inf"))
    own = torch.einsum("bkgcsd,bkcrd->bkgcsr", q, k)
    probs = torch.softmax(torch.cat([seen, own], dim=-1).float() * scale, dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :t].reshape(b, kv, g, c * s, t), context_v.unsqueeze(2))
    own_out = torch.einsum("bkgcsr,bkcrd->bkgcsd", probs[..., t:], v)
    return out.view(b, kv, g, c, s, hd) + own_out
