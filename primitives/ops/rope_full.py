"""Pairwise family, RoPE with each half of the tables read: ``apply_rotary_pos_emb`` on any
cos/sin tables.

``rope`` reads column ``p = k mod D/2`` of the tables for both members of pair k — Hugging Face's
tables repeat their halves (``emb = cat(freqs, freqs)``), so that is its rotation. A block written
from model code states ``q·cos + rotate_half(q)·sin`` for *any* tables, and then the second member
of a pair (rotate-half index ``p + D/2``) is multiplied by column ``p + D/2``. ``rope_full`` reads
both halves (two more table gathers per tile) and so matches that statement on every input; on
Hugging Face's tables it equals ``rope``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from ..base import EpilogueOp, Name, Port
from ..sizes import SizeExpr
from .rope import check_rotation, emit_rotation, reference_rotation

if TYPE_CHECKING:
    from ..checking import CheckEnv
    from ..codegen.context import EmitContext
    from ..reference import RefEnv


class RopeFull(EpilogueOp):
    """RoPE on adjacent pairs like ``rope``, each member with its own table column, 2→2.

    Pair k is the rotate-half pair ``(p, p + D/2)``, ``p = k mod D/2``: ``out[:, 2k] = x·cos[i,
    p] − y·sin[i, p]``, ``out[:, 2k+1] = y·cos[i, p + D/2] + x·sin[i, p + D/2]`` — Hugging Face's
    ``apply_rotary_pos_emb`` on any tables. ``rotary_cols`` as for ``rope``.
    """

    op: Literal["rope_full"] = "rope_full"
    port: ClassVar = Port.TILE

    src: Name
    cos: Name
    sin: Name
    out: Name
    rotary_cols: SizeExpr | None = None

    def check(self, env: CheckEnv) -> None:
        check_rotation(self, env)

    def reference(self, env: RefEnv) -> None:
        reference_rotation(self, env, inverse=False, full_tables=True)

    def emit(self, ctx: EmitContext) -> None:
        emit_rotation(self, ctx, inverse=False, full_tables=True)
