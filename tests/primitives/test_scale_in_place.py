"""``primitives/scale_in_place.py``: in-place scaling by a factor read on the device, the kernel
run through Triton's interpreter on odd sizes against the fp32 product; a factor of exactly 1
leaves the tensor as it was, bit for bit."""

from __future__ import annotations

import pytest
import torch

from coda.primitives.scale_in_place import scale_on_device, scale_unless_one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 4095, 4097, 3 * 1237])
@pytest.mark.parametrize("value", [1.0, 0.37, -2.75, 0.0, 1.0009, float("nan")])
def test_the_kernel_multiplies_in_fp32_rounding_once(
    dtype: torch.dtype, n: int, value: float
) -> None:
    """The product in fp32, rounded once to the tensor's dtype — what ``mul_`` computes on the
    CPU, with the factor not rounded to a 16-bit dtype first."""
    torch.manual_seed(n)
    t = (torch.randn(n) * 7).to(dtype)
    factor = torch.tensor(value, dtype=torch.float32)
    want = (t.float() * value).to(dtype)
    torch.testing.assert_close(t.clone().mul_(factor), want, atol=0, rtol=0, equal_nan=True)
    scale_on_device((t,), factor)
    torch.testing.assert_close(t, want, atol=0, rtol=0, equal_nan=True)


def test_fewer_programs_than_blocks_cover_the_whole_tensor() -> None:
    """Two programs over five blocks: each loops over its share, the last block partial."""
    t = torch.arange(4 * 4096 + 33, dtype=torch.float32)
    scale_on_device((t,), torch.tensor(3.0), max_programs=2)
    torch.testing.assert_close(t, torch.arange(4 * 4096 + 33, dtype=torch.float32) * 3)


def test_a_factor_of_one_leaves_every_value_as_it_was() -> None:
    """NaNs, infinities and signed zeros included: nothing is rewritten."""
    t = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, -3.5] * 1000, dtype=torch.float32)
    before = t.clone()
    scale_on_device((t,), torch.ones(1))
    assert torch.equal(t.view(torch.int32), before.view(torch.int32))


def test_three_tensors_of_any_dtypes_and_sizes_are_one_launch() -> None:
    """dx, dγ and dW of a loss in one launch, whatever their dtypes and sizes (an empty one
    among them), fewer programs than blocks so programs cross from one tensor to the next;
    a fourth tensor takes a second launch. Each product is the fp32 one rounded once; a factor
    of exactly 1 leaves every bit."""
    from coda.primitives.launch import recorded_launches

    torch.manual_seed(0)
    made = [
        (torch.randn(3 * 4096 + 5) * 3).half(),
        torch.randn(17),
        torch.empty(0),
        (torch.randn(2 * 4096 - 1) * 5).half(),
        torch.randn(4096 + 1),
    ]
    for value in (0.37, 1.0):
        ts = [t.clone() for t in made]
        with recorded_launches() as launches:
            scale_on_device(ts, torch.tensor(value), max_programs=2)
        (_, grid, first, _), (_, _, second, _) = launches  # the empty tensor in neither
        assert grid == (2,) and all(
            a is t for a, t in zip(first[:6:2], ts[:2] + ts[3:4], strict=True)
        )
        assert first[1:6:2] == (ts[0].numel(), 17, ts[3].numel())
        assert second[0] is ts[4] and second[1:6:2] == (4097, 0, 0)
        for got, t in zip(ts, made, strict=True):
            want = t if value == 1.0 else (t.float() * value).to(t.dtype)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), value


def test_a_strided_view_or_a_wrong_factor_is_refused_by_the_kernel() -> None:
    t = torch.zeros(6, 8)
    with pytest.raises(ValueError, match="contiguous"):
        scale_on_device((t, t.T), torch.tensor(2.0))
    with pytest.raises(ValueError, match="one-element factor"):
        scale_on_device((t,), torch.tensor([2.0, 3.0]))


def test_scale_unless_one_on_the_cpu_multiplies_unless_the_factor_is_one() -> None:
    a, b = torch.randn(5, 3), torch.randn(7).to(torch.float16)
    a0, b0 = a.clone(), b.clone()
    scale_unless_one((a, None, b), torch.tensor(1.0))
    assert torch.equal(a, a0) and torch.equal(b, b0)
    strided = torch.randn(4, 6).T
    want = strided.clone() * 0.25
    scale_unless_one((a, b, strided), torch.tensor(0.25))
    torch.testing.assert_close(a, a0 * 0.25, atol=0, rtol=0)
    torch.testing.assert_close(b, b0.mul_(torch.tensor(0.25)), atol=0, rtol=0)
    torch.testing.assert_close(strided, want, atol=0, rtol=0)


def test_the_kernel_compiles_for_hopper() -> None:
    """The kernel as a GPU compiles it (sm_90; bf16, fp32 and bf16 tensors, one size 64-bit):
    Triton's compiler refuses what its interpreter runs — a name of another dtype in each branch
    of an ``if`` did — so this fails on a CPU, not in a user's first training step."""
    from tests.helpers import compile_for_hopper

    signature = {
        "a_ptr": "*bf16", "a_n": "i32", "b_ptr": "*fp32", "b_n": "i32", "c_ptr": "*bf16",
        "c_n": "i64", "factor_ptr": "*fp32",
    }  # fmt: skip
    ptx = compile_for_hopper(
        "coda.primitives.scale_in_place:_scale_in_place_kernel", signature, {"BLOCK": 4096}
    )
    assert ".entry _scale_in_place_kernel" in ptx
