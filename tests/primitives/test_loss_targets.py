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


def test_labels_that_are_not_class_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="integer class ids"):
        next_token_targets(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="one element"):
        targets_on_device(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 2]))


@pytest.mark.parametrize(
    ("labels", "den", "den_from_ptr", "count"),
    [
        ("*i64", "*fp32", False, True),
        ("*i64", "*i64", True, False),
        ("*i32", "*fp32", False, False),
    ],
    ids=["counted", "device-tensor", "int32-given"],
)
def test_the_kernel_compiles_for_hopper(
    labels: str, den: str, den_from_ptr: bool, count: bool
) -> None:
    """The interpreter runs the kernel's Python; this compiles it for sm_90 as a GPU would, so a
    construct only the compiler refuses fails here, on a CPU, and not in a user's first training
    step."""
    signature = {
        "labels_ptr": labels, "classes_ptr": labels, "weights_ptr": "*fp32", "den_ptr": den,
        "n": "i32", "length": "i32", "stride_row": "i32", "stride_col": "i32", "den_value": "fp32",
    }  # fmt: skip
    constexprs = {"DEN_FROM_PTR": den_from_ptr, "COUNT_DEN": count, "IGNORE": -100, "BLOCK": 1024}
    ptx = compile_for_hopper(
        "coda.primitives.loss_targets:_next_token_targets_kernel", signature, constexprs
    )
    assert "div.rn.f32" in ptx  # the weights' division rounds as PyTorch's
