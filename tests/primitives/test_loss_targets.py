"""``coda.primitives.loss_targets``: the one-launch kernel (in Triton's interpreter on the CPU)
against the PyTorch ops it replaces, bit for bit, at odd shapes and layouts, with and without a
denominator given."""

from __future__ import annotations

import pytest
import torch

from coda.primitives.loss_targets import (
    IGNORE_INDEX,
    next_token_targets,
    targets_by_ops,
    targets_on_device,
)
from tests.helpers import compile_for_hopper


def _labels(shape: tuple[int, ...], ignored: float, seed: int, dtype=torch.int64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 50, shape, generator=gen, dtype=dtype)
    mask = torch.rand(shape, generator=gen) < ignored
    return labels.masked_fill(mask, IGNORE_INDEX)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)  # dtype, shape, bits


@pytest.mark.parametrize(
    "shape", [(1, 7), (3, 5), (2, 1), (1, 1), (2, 1500), (9,)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
def test_the_kernel_computes_what_the_ops_compute(shape: tuple[int, ...], ignored: float) -> None:
    labels = _labels(shape, ignored, seed=len(shape) + shape[0])
    _same(targets_on_device(labels), targets_by_ops(labels))


@pytest.mark.parametrize(
    "num_items",
    [7, 0, torch.tensor(5), torch.tensor([3]), torch.tensor(6.0, dtype=torch.float64)],
    ids=["int", "zero", "tensor", "one-element", "float64"],
)
def test_a_given_denominator_replaces_the_count(num_items: int | torch.Tensor) -> None:
    labels = _labels((2, 13), 0.25, seed=3)
    _same(targets_on_device(labels, num_items), targets_by_ops(labels, num_items))


@pytest.mark.parametrize("layout", ["strided", "transposed", "int32"])
def test_any_layout_and_integer_dtype(layout: str) -> None:
    base = _labels((3, 20), 0.2, seed=5, dtype=torch.int32 if layout == "int32" else torch.int64)
    labels = {"strided": base[:, ::2], "transposed": base.T, "int32": base}[layout]
    _same(targets_on_device(labels), targets_by_ops(labels))


def test_each_position_targets_the_next_label_and_the_last_none() -> None:
    labels = torch.tensor([[4, 9, IGNORE_INDEX, 2], [1, 1, 3, 8]])
    classes, weights = next_token_targets(labels)  # a CPU tensor: the ops
    assert classes.tolist() == [9, 0, 2, 0, 1, 3, 8, 0]
    fifth = torch.tensor(1.0) / 5  # five tokens counted
    assert torch.equal(weights, torch.tensor([1, 0, 1, 0, 1, 1, 1, 0]) * fifth)
    _same(targets_on_device(labels), (classes, weights))


def test_targets_outside_the_vocabulary_weigh_nan_in_the_kernel_and_raise_on_the_host() -> None:
    """A label outside ``[0, vocab)`` (not -100) has no logit: the kernel gives its token class 0
    and weight NaN (a GPU cannot raise without the host waiting), the other tokens as before; the
    host, holding CPU labels, raises ``IndexError`` naming the label. Inside the vocabulary a
    ``vocab`` changes nothing."""
    labels = torch.tensor([[4, 9, 50, 2], [1, -5, 3, IGNORE_INDEX]])
    classes, weights = targets_on_device(labels, vocab=50)
    assert classes.tolist() == [9, 0, 2, 0, 0, 3, 0, 0]
    fifth = torch.tensor(1.0) / 5  # five targets that are not -100 (two of them outside)
    nan = float("nan")
    want = torch.tensor([1, nan, 1, 0, nan, 1, 0, 0]) * fifth
    torch.testing.assert_close(weights, want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(IndexError, match=r"label 50 is not a class of the vocabulary \[0, 50\)"):
        next_token_targets(labels, vocab=50)
    with pytest.raises(IndexError, match="label -5 "):
        next_token_targets(labels[1:], vocab=50)
    inside = _labels((3, 11), 0.3, seed=9)
    _same(targets_on_device(inside, vocab=50), targets_by_ops(inside))
    _same(next_token_targets(inside, vocab=50), targets_by_ops(inside))


def test_labels_that_are_not_class_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="integer class ids"):
        next_token_targets(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one element"):
        targets_on_device(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 2]))


@pytest.mark.parametrize(
    ("labels", "den", "den_from_ptr", "count", "check"),
    [
        ("*i64", "*fp32", False, True, True),
        ("*i64", "*i64", True, False, False),
        ("*i32", "*fp32", False, False, True),
    ],
    ids=["counted-checked", "device-tensor", "int32-given-checked"],
)
def test_the_kernel_compiles_for_hopper(
    labels: str, den: str, den_from_ptr: bool, count: bool, check: bool
) -> None:
    """The interpreter runs the kernel's Python; this compiles it for sm_90 as a GPU would, so a
    construct only the compiler refuses fails here, on a CPU, and not in a user's first training
    step."""
    signature = {
        "labels_ptr": labels, "classes_ptr": labels, "weights_ptr": "*fp32", "den_ptr": den,
        "n": "i32", "length": "i32", "stride_row": "i32", "stride_col": "i32", "den_value": "fp32",
        "vocab": "i32",
    }  # fmt: skip
    constexprs = {
        "DEN_FROM_PTR": den_from_ptr, "COUNT_DEN": count, "IGNORE": -100, "CHECK_RANGE": check,
        "BLOCK": 1024,
    }  # fmt: skip
    ptx = compile_for_hopper(
        "coda.primitives.loss_targets:_next_token_targets_kernel", signature, constexprs
    )
    assert "div.rn.f32" in ptx  # the weights' division rounds as PyTorch's
