"""``coda.export.heads.split_heads``: q, k and v heads as views of the packed projection, equal
to the plain views in value and gradient, with a backward that writes the packed gradient in one
``cat`` and copies nothing else."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coda.export.heads import split_heads

B, T, D, HQ, HKV = 2, 5, 8, 4, 2
WIDTHS = (HQ * D, HKV * D, HKV * D)


class _Ops(TorchDispatchMode):
    """The ATen ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _plain_heads(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    parts = qkv.split(list(WIDTHS), dim=-1)
    return tuple(p.view(B, T, -1, D).transpose(1, 2) for p in parts)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum()


def _backward_ops(
    heads, qkv: torch.Tensor, grads: list[torch.Tensor]
) -> tuple[list[str], torch.Tensor]:  # noqa: ANN001
    """The ATen ops of the backward of ``heads(qkv)`` given the heads' gradients, and qkv's."""
    with _Ops() as ops:
        (grad,) = torch.autograd.grad(heads(qkv), qkv, grads)
    return ops.names, grad


def test_the_heads_are_the_plain_views_with_the_same_gradient() -> None:
    qkv = torch.randn(B, T, sum(WIDTHS), requires_grad=True)
    for got, want in zip(split_heads(qkv, WIDTHS, D), _plain_heads(qkv), strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr() and got.stride() == want.stride()  # no copy
    got = torch.autograd.grad(_attention(*split_heads(qkv, WIDTHS, D)), qkv)[0]
    want = torch.autograd.grad(_attention(*_plain_heads(qkv)), qkv)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_backward_packs_the_gradients_in_one_cat_where_the_views_copy_first() -> None:
    qkv = torch.randn(B, T, sum(WIDTHS), requires_grad=True)
    # the attention's gradients as they reach the views: contiguous in [B, heads, T, D] order
    grads = [torch.randn(B, h, T, D) for h in (HQ, HKV, HKV)]
    plain_ops, want = _backward_ops(_plain_heads, qkv, grads)
    ops, got = _backward_ops(lambda x: split_heads(x, WIDTHS, D), qkv, grads)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    copies = {"clone", "copy_", "_to_copy", "contiguous"}
    assert copies & set(plain_ops)  # the plain views' backward copies before its cat
    assert ops.count("cat") == 1 and not copies & set(ops), ops


def test_a_part_without_gradient_gets_zeros() -> None:
    qkv = torch.randn(B, T, sum(WIDTHS), requires_grad=True)
    q, k, _ = split_heads(qkv, WIDTHS, D)
    (grad,) = torch.autograd.grad((q * 2).sum() + k.sum(), qkv)
    assert torch.equal(grad[..., : WIDTHS[0]], torch.full((B, T, WIDTHS[0]), 2.0))
    assert torch.equal(grad[..., WIDTHS[0] : WIDTHS[0] + WIDTHS[1]], torch.ones(B, T, WIDTHS[1]))
    assert torch.equal(grad[..., WIDTHS[0] + WIDTHS[1] :], torch.zeros(B, T, WIDTHS[2]))


@pytest.mark.parametrize(
    "shape,widths,match",
    [
        ((T, sum(WIDTHS)), WIDTHS, "takes qkv"),
        ((B, T, sum(WIDTHS)), (HQ * D, HKV * D, HKV * D + 1), "sum to"),
        ((B, T, sum(WIDTHS) + 3), (HQ * D, HKV * D, HKV * D + 3), "multiple of head_dim"),
    ],
)
def test_shapes_that_are_not_heads_are_refused(shape, widths, match) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        split_heads(torch.zeros(shape), widths, D)
