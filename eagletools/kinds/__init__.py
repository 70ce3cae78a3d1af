"""Draft kinds: what an EAGLE-3, a P-EAGLE and a DFlash draft do differently.

A kind is one `DraftKind` object, and every part of eagletools that depends on
the kind reads it there: the trainer (the module it trains, objective and
unroll), the decoder (how a step proposes tokens), the formats (the
architectures each layout writes and reads), the engine-option table (which
engines serve the kind) and `doctor`. A draft's kind is its config's `kind`
field; `kind_of` turns it into the object, refusing names it does not know.
"""

from __future__ import annotations

from eagletools.draft import DraftConfig
from eagletools.errors import UserError
from eagletools.kinds.base import Drafter, DraftKind
from eagletools.kinds.dflash import DFLASH
from eagletools.kinds.eagle3 import EAGLE3
from eagletools.kinds.peagle import PEAGLE

KINDS: dict[str, DraftKind] = {k.name: k for k in (EAGLE3, PEAGLE, DFLASH)}


def kind_of(config: DraftConfig, source: str = "draft config") -> DraftKind:
    """The kind a draft config names, which has checked the config is one it runs."""
    if config.kind not in KINDS:
        raise UserError(
            f"{source}: field 'kind' is {config.kind!r}; known kinds: {', '.join(KINDS)}"
        )
    kind = KINDS[config.kind]
    kind.validate(config, source)
    return kind


__all__ = ["KINDS", "DraftKind", "Drafter", "kind_of"]
