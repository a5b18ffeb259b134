"""How a drop-in gets its Programs: the shipped verified ones, or verified in the sandbox now.

* ``dropin_programs(family, keys, eps, verify)``: the Programs of a ``coda.export.programs``
  family's blocks at an RMSNorm epsilon. By default (``verify=False``) each is the planner's
  Program checked to be the shipped verified one up to the epsilon (milliseconds, no worker);
  with ``verify=True``, or when that check fails (a warning says why), each is verified by the
  sandbox first (a worker per Program, about 2 s each), and ``NotVerified`` if it does not pass.
  Either way, no Program runs that the sandbox has not verified.
* ``verified_program(block)``: the planner's Program for any block, verified by the sandbox.

The sandbox is imported only when a Program is verified here.
"""

from __future__ import annotations

import warnings

from coda.blocks.block import Block
from coda.primitives.ir import Program

from .programs import FAMILIES, LoweringOptions, ShippedMismatch, lowered, shipped_program


class NotVerified(RuntimeError):
    """The sandbox did not verify a Program the export was asked to use."""


class ShippedProgramWarning(UserWarning):
    """A shipped Program could not be used; the Program was verified in the sandbox instead."""


def verified_program(block: Block, options: LoweringOptions | None = None) -> Program:
    """The built-in planner's Program for ``block``, verified by the sandbox (else
    ``NotVerified``)."""
    from coda.sandbox import SandboxOptions, evaluate

    program = lowered(block, options)
    report = evaluate(program, block, SandboxOptions(profile=False, seeds=[0]))
    if not report.verified:
        raise NotVerified(f"{block.name}: {report.render_compact()}")
    return program


def dropin_programs(
    family: str, keys: tuple[str, ...] | list[str], eps: float, *, verify: bool
) -> list[Program]:
    """The Programs of ``FAMILIES[family]``'s ``keys`` blocks at ``eps``, in that order: verified
    by the sandbox now (``verify``), else the shipped verified ones (``shipped_program``), each
    falling back to the sandbox with a ``ShippedProgramWarning`` when it does not match."""
    blocks = FAMILIES[family].blocks(eps)
    return [_program(family, key, blocks[key], eps, verify) for key in keys]


def _program(family: str, key: str, block: Block, eps: float, verify: bool) -> Program:
    options = FAMILIES[family].options
    if verify:
        return verified_program(block, options)
    try:
        return shipped_program(family, key, eps)
    except ShippedMismatch as e:
        warnings.warn(
            f"{e}; verifying {block.name} in the sandbox instead", ShippedProgramWarning, 3
        )
        return verified_program(block, options)
