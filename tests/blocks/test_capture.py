"""``Block.from_torch``: each recogniser on the spellings it reads, what stays ``Opaque`` (and
that the planner names it), the user's function as the reference (float64 casts kept float64),
its source, and the errors of functions that cannot be captured. Each capture is one export on
meta tensors (no kernel runs here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from coda.blocks import (
    GLU,
    Activation,
    Add,
    Block,
    BlockFileError,
    Chunk,
    HeadRMSNorm,
    LayerNorm,
    Linear,
    Opaque,
    RMSNorm,
    RoPE,
    Scale,
    ShapeSets,
    SwiGLU,
    TensorSpec,
    load_block_file,
    register,
)
from coda.blocks.capture import CapturedBlock, CaptureError
from coda.blocks.ops import CrossEntropy
from coda.planner import NoRule, lower
from tests.helpers import captured_residual_file

ACT = TensorSpec(shape=["M", "d"])
VEC = TensorSpec(shape=["d"], init="norm_weight")
SIZES = ShapeSets(cpu=[{"M": 6, "d": 40, "f": 24}, {"M": 1, "d": 8, "f": 4}])


def by_out(block: Block) -> dict[str, object]:
    return {op.out: op for op in block.graph}


# -- recognisers -----------------------------------------------------------------------------------
def llama_rms(x, w, eps=1e-5):
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def gemma_rms(x, w, eps=1e-6):
    out = x.float()
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


def olmo_rms(x, w, eps=1e-6):
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(dtype)


def norms(x, w, b):
    return {
        "llama": llama_rms(x, w),
        "gemma": gemma_rms(x, w),
        "olmo": olmo_rms(x, w),
        "aten": F.rms_norm(x, (x.shape[-1],), w, eps=1e-6),
        "ln": F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        "ln_nobias": F.layer_norm(x, (x.shape[-1],), w, None, 1e-6),
    }


def test_rmsnorm_and_layernorm_spellings_and_their_casts() -> None:
    block = Block.from_torch(
        norms, name="norms", inputs={"x": ACT, "w": VEC, "b": VEC}, shapes=SIZES
    )
    ops = by_out(block)
    assert ops["llama"] == RMSNorm(x="x", weight="w", eps=1e-5, out="llama")
    assert ops["gemma"] == RMSNorm(
        x="x", weight="w", eps=1e-6, offset=1.0, cast="after_weight", out="gemma"
    )
    assert ops["olmo"] == RMSNorm(x="x", weight="w", eps=1e-6, cast="after_weight", out="olmo")
    assert ops["aten"] == RMSNorm(x="x", weight="w", eps=1e-6, out="aten")
    assert ops["ln"] == LayerNorm(x="x", weight="w", bias="b", eps=1e-5, out="ln")
    assert ops["ln_nobias"] == LayerNorm(x="x", weight="w", eps=1e-6, out="ln_nobias")
    assert len(block.graph) == 6


def projections(x, w, w2, b):
    return {
        "plain": F.linear(x, w),
        "biased": F.linear(x, w, b),
        "matmul": x @ w2.t() + b,
        "dot_T": torch.mm(x, w.T),
        "addmm": torch.addmm(b, x, w2.t()),
    }


def test_linear_spellings() -> None:
    block = Block.from_torch(
        projections,
        name="projections",
        inputs={
            "x": ACT,
            "w": TensorSpec(shape=["f", "d"], init="linear_weight"),
            "w2": TensorSpec(shape=["f", "d"], init="linear_weight"),
            "b": TensorSpec(shape=["f"]),
        },
        shapes=SIZES,
    )
    ops = by_out(block)
    assert ops["plain"] == Linear(x="x", weight="w", out="plain")
    assert ops["biased"] == Linear(x="x", weight="w", bias="b", out="biased")
    assert ops["matmul"] == Linear(x="x", weight="w2", bias="b", out="matmul")
    assert ops["dot_T"] == Linear(x="x", weight="w", out="dot_T")
    assert ops["addmm"] == Linear(x="x", weight="w2", bias="b", out="addmm")


def elementwise(x, y):
    return {
        "gelu": F.gelu(x),
        "gelu_tanh": F.gelu(x, approximate="tanh"),
        "silu": F.silu(x),
        "silu_by_hand": x * torch.sigmoid(x),
        "relu": F.relu(x),
        "relu2": torch.square(F.relu(x)),
        "sigmoid": torch.sigmoid(x),
        "tanh": torch.tanh(x),
        "quick_gelu": x * torch.sigmoid(1.702 * x),
        "softcap": torch.tanh(x / 30.0) * 30.0,
        "softcap_by_product": 50.0 * torch.tanh(x * (1 / 50.0)),
        "swiglu": F.silu(x) * y,
        "geglu": y * F.gelu(x, approximate="tanh"),
        "residual": x + F.dropout(y, p=0.1, training=False),
        "scaled": x * 0.125,
        "divided": x / 4.0,
    }


def test_activations_gated_units_residuals_and_scales() -> None:
    block = Block.from_torch(
        elementwise, name="elementwise", inputs={"x": ACT, "y": ACT}, shapes=SIZES
    )
    ops = by_out(block)
    for kind in ("gelu", "gelu_tanh", "silu", "relu", "relu2", "sigmoid", "tanh", "quick_gelu"):
        assert ops[kind] == Activation(x="x", kind=kind, out=kind), kind
    assert ops["silu_by_hand"] == Activation(x="x", kind="silu", out="silu_by_hand")
    assert ops["softcap"] == Activation(x="x", kind="softcap", cap=30.0, out="softcap")
    assert ops["softcap_by_product"] == Activation(
        x="x", kind="softcap", cap=50.0, out="softcap_by_product"
    )
    assert ops["swiglu"] == SwiGLU(gate="x", up="y", out="swiglu")
    assert ops["geglu"] == GLU(gate="x", up="y", act="gelu_tanh", out="geglu")
    assert ops["residual"] == Add(a="x", b="y", out="residual")
    assert ops["scaled"] == Scale(x="x", factor=0.125, out="scaled")
    assert ops["divided"] == Scale(x="x", factor=0.25, out="divided")
    assert len(block.graph) == 16


def written_out(x, y):
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
    return {
        "gelu_new": 0.5 * x * (1.0 + torch.tanh(inner)),
        "sigmoid": 1.0 / (1.0 + torch.exp(-x.float())).to(x.dtype),
        "gated": y * (x * torch.sigmoid(x)),
        "cubic": x * x * x + 1.0,
    }


def test_activations_written_out_are_recognised_by_their_values() -> None:
    block = Block.from_torch(
        written_out, name="written_out", inputs={"x": ACT, "y": ACT}, shapes=SIZES
    )
    ops = by_out(block)
    assert ops["gelu_new"] == Activation(x="x", kind="gelu_tanh", out="gelu_new")
    assert ops["sigmoid"] == Activation(x="x", kind="sigmoid", out="sigmoid")
    assert ops["gated"] == SwiGLU(gate="x", up="y", out="gated")
    cubic = ops["cubic"]  # an elementwise chain that is no activation stays opaque
    assert isinstance(cubic, Opaque) and "adds one" in cubic.reason


def fused_mlp(z):
    gate, up = z.chunk(2, dim=-1)
    first, second = z.split(z.shape[-1] // 2, dim=-1)
    return {"a": up * F.silu(gate), "b": second + first}


def test_chunk_and_split_of_a_concatenated_projection() -> None:
    block = Block.from_torch(
        fused_mlp,
        name="fused",
        inputs={"z": TensorSpec(shape=["M", "f2"])},
        shapes=ShapeSets(cpu=[{"M": 6, "f2": 48}]),
    )
    chunks = [op for op in block.graph if isinstance(op, Chunk)]
    assert [(c.chunks, c.index) for c in chunks] == [(2, 0), (2, 1), (2, 1), (2, 0)]
    assert by_out(block)["a"] == SwiGLU(gate=chunks[0].out, up=chunks[1].out, out="a")


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotated(q, k, w, cos, sin):
    rows, head = q.shape[0], cos.shape[-1]
    qh = q.view(rows, -1, head)
    kh = llama_rms(k.view(rows, -1, head), w, eps=1e-6)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = qh * c + rotate_half(qh) * s
    k_embed = (kh * c) + (rotate_half(kh) * s)
    return {"q_rot": q_embed.reshape(rows, -1), "k_rot": k_embed.reshape(rows, -1)}


ROTATED_INPUTS = {
    "q": TensorSpec(shape=["M", "Nq"]),
    "k": TensorSpec(shape=["M", "Nkv"]),
    "w": TensorSpec(shape=["D"], init="norm_weight"),
    "cos": TensorSpec(shape=["M", "D"]),
    "sin": TensorSpec(shape=["M", "D"]),
}


def test_rope_and_head_rmsnorm_absorb_their_head_views() -> None:
    block = Block.from_torch(
        rotated,
        name="rotated",
        inputs=ROTATED_INPUTS,
        shapes=ShapeSets(cpu=[{"M": 6, "Nq": 32, "Nkv": 16, "D": 8}]),
    )
    (norm,) = [op for op in block.graph if isinstance(op, HeadRMSNorm)]
    assert norm == HeadRMSNorm(x="k", weight="w", eps=1e-6, out=norm.out)
    ops = by_out(block)
    assert ops["q_rot"] == RoPE(x="q", cos="cos", sin="sin", out="q_rot")
    assert ops["k_rot"] == RoPE(x=norm.out, cos="cos", sin="sin", out="k_rot")
    assert len(block.graph) == 3


def rotated_heads_first(q, k, w, cos, sin):
    """The same with the heads axis first, as Hugging Face's attention keeps q and k."""
    rows, head = q.shape[0], cos.shape[-1]
    qh = q.view(rows, -1, head).transpose(0, 1)
    kh = llama_rms(k.view(rows, -1, head), w, eps=1e-6).transpose(0, 1)
    c, s = cos.unsqueeze(0), sin.unsqueeze(0)
    q_embed = qh * c + rotate_half(qh) * s
    k_embed = kh * c + rotate_half(kh) * s
    return {
        "q_rot": q_embed.transpose(0, 1).reshape(rows, -1),
        "k_rot": k_embed.transpose(0, 1).reshape(rows, -1),
        "q_wrong": (qh * cos.unsqueeze(1)).transpose(0, 1).reshape(rows, -1),
    }


def test_rope_on_heads_first_views_and_a_table_on_the_wrong_axis() -> None:
    block = Block.from_torch(
        rotated_heads_first,
        name="rotated_heads_first",
        inputs=ROTATED_INPUTS,
        shapes=ShapeSets(cpu=[{"M": 4, "Nq": 32, "Nkv": 16, "D": 8}]),  # M == H for q
    )
    (norm,) = [op for op in block.graph if isinstance(op, HeadRMSNorm)]
    ops = by_out(block)
    assert ops["q_rot"] == RoPE(x="q", cos="cos", sin="sin", out="q_rot")
    assert ops["k_rot"] == RoPE(x=norm.out, cos="cos", sin="sin", out="k_rot")
    # cos unsqueezed at 1 against [H, M, D] indexes cos by head (H == M here): no RoPE
    assert isinstance(ops["q_wrong"], Opaque)
    inputs = block.make_inputs({"M": 4, "Nq": 32, "Nkv": 16, "D": 8}, torch.float64, seed=0)
    want = rotated(**inputs)
    got = block.reference(inputs)
    torch.testing.assert_close(got["q_rot"], want["q_rot"], rtol=0, atol=1e-15)


def losses(logits, target):
    return {
        "loss": F.cross_entropy(logits.float(), target, reduction="none"),
        "mean": F.cross_entropy(logits.float(), target),
    }


def test_cross_entropy_per_token_and_a_reduced_one_left_opaque() -> None:
    block = Block.from_torch(
        losses,
        name="losses",
        inputs={
            "logits": TensorSpec(shape=["M", "V"]),
            "target": TensorSpec(shape=["M"], dtype="int64", init="index", high="V"),
        },
        shapes=ShapeSets(cpu=[{"M": 6, "V": 50}]),
    )
    ops = by_out(block)
    assert ops["loss"] == CrossEntropy(logits="logits", target="target", out="loss")
    mean = ops["mean"]
    assert isinstance(mean, Opaque) and "reduction='mean'" in mean.reason
    assert mean.target == "aten.cross_entropy_loss.default"


# -- opaque ----------------------------------------------------------------------------------------
def with_cumsum(x, w):
    return {"out": F.linear(torch.cumsum(x, dim=-1), w)}


def test_an_unrecognised_op_is_opaque_and_the_planner_names_it() -> None:
    block = Block.from_torch(
        with_cumsum,
        name="with_cumsum",
        inputs={"x": ACT, "w": TensorSpec(shape=["f", "d"], init="linear_weight")},
        shapes=SIZES,
    )
    opaque, linear = block.graph
    assert isinstance(opaque, Opaque) and linear == Linear(x=opaque.out, weight="w", out="out")
    assert opaque.target == "aten.cumsum.default" and opaque.tensors == ["x"]
    assert opaque.shape == ["M", "d"] and opaque.dtype == "bfloat16"
    assert opaque.reason == "no block op computes aten.cumsum.default"
    assert opaque.call_text == "aten.cumsum.default(x, -1)"
    with pytest.raises(NotImplementedError, match=r"'cumsum_1' is opaque \(aten.cumsum.default\)"):
        opaque.call({"x": torch.zeros(2, 3)})
    assert block.trace({"M": 3, "d": 5, "f": 7})[opaque.out] == (3, 5)
    with pytest.raises(NoRule, match=r"opaque\(out='cumsum_1'\).*captured aten.cumsum"):
        lower(block)
    # the reference is the function, so the block still runs
    inputs = block.make_inputs({"M": 3, "d": 5, "f": 7}, torch.float32, seed=0)
    want = F.linear(torch.cumsum(inputs["x"], -1), inputs["w"])
    torch.testing.assert_close(block.reference(inputs)["out"], want, rtol=0, atol=0)


def test_opaque_shapes_are_unknown_when_the_function_has_no_dynamic_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coda.blocks.capture import capture

    static = capture.export

    def no_dynamic(*args, dynamic: bool = False, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if dynamic:
            raise CaptureError("no dynamic export here")
        return static(*args, **kwargs)

    monkeypatch.setattr(capture, "export", no_dynamic)
    block = Block.from_torch(
        with_cumsum,
        name="with_cumsum",
        inputs={"x": ACT, "w": TensorSpec(shape=["f", "d"], init="linear_weight")},
        shapes=SIZES,
    )
    opaque = block.graph[0]
    assert isinstance(opaque, Opaque) and opaque.shape == []
    shapes = block.trace({"M": 3, "d": 5, "f": 7})
    assert opaque.out not in shapes and shapes["out"] == (3, 7)  # the function's own


def aten_rms_without_eps(x, w):
    return F.rms_norm(x, (x.shape[-1],), w)


def test_rms_norm_without_eps_is_opaque_with_the_fix() -> None:
    block = Block.from_torch(
        aten_rms_without_eps, name="no_eps", inputs={"x": ACT, "w": VEC}, shapes=SIZES
    )
    (op,) = block.graph
    assert isinstance(op, Opaque) and "pass eps explicitly" in op.reason


# -- the reference ---------------------------------------------------------------------------------
def test_the_reference_is_the_function_with_float64_kept_in_float64() -> None:
    block = Block.from_torch(llama_rms, name="llama_rms", inputs={"x": ACT, "w": VEC}, shapes=SIZES)
    assert isinstance(block, CapturedBlock)
    inputs = block.make_inputs({"M": 5, "d": 24}, torch.float64, seed=1)
    x, w = inputs["x"], inputs["w"]
    exact = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = block.reference(inputs)["out"]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, exact, rtol=1e-14, atol=1e-14)  # not rounded to fp32
    half = {n: t.half() for n, t in inputs.items()}
    torch.testing.assert_close(block.reference(half)["out"], llama_rms(half["x"], half["w"]))


def test_reference_source_shows_the_function_and_the_functions_it_calls() -> None:
    block = Block.from_torch(
        rotated,
        name="rotated",
        inputs={
            "q": TensorSpec(shape=["M", "Nq"]),
            "k": TensorSpec(shape=["M", "Nkv"]),
            "w": TensorSpec(shape=["D"], init="norm_weight", doc="k_norm.weight"),
            "cos": TensorSpec(shape=["M", "D"]),
            "sin": TensorSpec(shape=["M", "D"]),
        },
        shapes=ShapeSets(cpu=[{"M": 6, "Nq": 32, "Nkv": 16, "D": 8}]),
    )
    source = block.reference_source()
    assert "def rotated(q, k, w, cos, sin):" in source
    assert "def rotate_half(x):" in source and "def llama_rms(x, w, eps=1e-5):" in source
    assert "def gemma_rms" not in source and "ACT =" not in source  # not called
    assert "#   w: [D] act — k_norm.weight" in source
    assert source.index("def rotate_half") < source.index("def rotated(")
    compile(source, "<reference>", "exec")


# -- errors ----------------------------------------------------------------------------------------
def branches_on_data(x, w):
    if x.sum() > 0:
        return F.linear(x, w)
    return x


def wrong_rank(x, w):
    return x @ w.t()


def test_untraceable_functions_say_what_failed_and_what_to_change() -> None:
    w = TensorSpec(shape=["f", "d"], init="linear_weight")
    with pytest.raises(CaptureError, match=r"branches on .*tensor values.*torch.where") as e:
        Block.from_torch(branches_on_data, name="b", inputs={"x": ACT, "w": w}, shapes=SIZES)
    assert "if x.sum() > 0:" in str(e.value)
    with pytest.raises(CaptureError, match=r"`return x @ w.t\(\)`") as e:
        Block.from_torch(
            wrong_rank, name="r", inputs={"x": ACT, "w": TensorSpec(shape=["f"])}, shapes=SIZES
        )
    assert "w ['f'] traced as [24]" in str(e.value) and "x ['M', 'd']" in str(e.value)


def test_inputs_and_outputs_must_match_the_function() -> None:
    with pytest.raises(CaptureError, match=r"parameter 'w' has no entry in inputs"):
        Block.from_torch(llama_rms, name="n", inputs={"x": ACT}, shapes=SIZES)
    with pytest.raises(CaptureError, match=r"inputs \['y'\] are not parameters"):
        Block.from_torch(llama_rms, name="n", inputs={"x": ACT, "w": VEC, "y": ACT}, shapes=SIZES)
    with pytest.raises(CaptureError, match=r"returns 2 tensors: name each of them"):
        Block.from_torch(
            lambda x, y: (x + y, x * 2.0), name="t", inputs={"x": ACT, "y": ACT}, shapes=SIZES
        )
    with pytest.raises(
        CaptureError, match=r"keys \['divided', 'geglu'.* but outputs names \['z'\]"
    ):
        Block.from_torch(
            elementwise, name="e", inputs={"x": ACT, "y": ACT}, shapes=SIZES, outputs=["z"]
        )


def passes_x_through(x, y):
    return {"out": x + y, "same": x}


def returns_twice(x, y):
    z = x + y
    return z, z


def ignores_y(x, y):
    return torch.tanh(x)


def test_outputs_must_be_computed_once_and_inputs_used() -> None:
    both = {"x": ACT, "y": ACT}
    with pytest.raises(CaptureError, match="output 'same' is the input 'x' unchanged"):
        Block.from_torch(passes_x_through, name="p", inputs=both, shapes=SIZES)
    with pytest.raises(CaptureError, match="outputs 'a' and 'b' are the same tensor"):
        Block.from_torch(returns_twice, name="t", inputs=both, shapes=SIZES, outputs=["a", "b"])
    with pytest.raises(CaptureError, match=r"ignores_y\(\) does not use its inputs \['y'\]"):
        Block.from_torch(ignores_y, name="i", inputs=both, shapes=SIZES)


def test_a_module_or_a_function_without_source_is_refused() -> None:
    with pytest.raises(CaptureError, match="takes a Python function, not Linear"):
        Block.from_torch(torch.nn.Linear(4, 4), name="m", inputs={"x": ACT}, shapes=SIZES)
    scope: dict = {"torch": torch}
    exec("def typed_in(x):\n    return torch.tanh(x)\n", scope)
    with pytest.raises(CaptureError, match=r"source of typed_in\(\) cannot be read"):
        Block.from_torch(scope["typed_in"], name="t", inputs={"x": ACT}, shapes=SIZES)


BLOCK_FILE = captured_residual_file("captured_proj_residual", [{"M": 5, "d": 24}])


def test_a_block_file_that_captures_and_one_whose_capture_fails(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(BLOCK_FILE)
    (block,) = load_block_file(good)
    assert block.name == "captured_proj_residual"
    assert [op.op for op in block.graph] == ["linear", "add"]
    assert "def proj_residual(x, w):" in block.reference_source()
    bad = tmp_path / "bad.py"
    bad.write_text(BLOCK_FILE.replace("return x +", "return x if x.sum() > 0 else x +"))
    with pytest.raises(BlockFileError, match=r"bad.py.*CaptureError.*torch.export could not"):
        load_block_file(bad)


def test_scale_factor_is_exact() -> None:
    block = Block.from_torch(
        lambda x: x * math.sqrt(40.0), name="s", inputs={"x": ACT}, shapes=SIZES
    )
    assert block.graph == [Scale(x="x", factor=math.sqrt(40.0), out="out")]


# -- backward blocks of captured functions ---------------------------------------------------------
def gated(x, w):
    return x + F.silu(F.linear(x, w))


def gated_pair(x, w):
    return F.linear(x, w), torch.tanh(x) * 2.0


def gated_dict(x, w):
    return {"y": F.linear(x, w) * x}


@pytest.mark.parametrize("fn", [gated, gated_pair, gated_dict])
def test_a_backward_block_of_a_captured_function_shows_source_that_runs(fn) -> None:  # noqa: ANN001
    """The vjp's source differentiates a function of the shown source that returns the outputs
    by name (a tensor or tuple result is wrapped), and runs as the backward's reference."""
    from coda.blocks.autodiff import backward_block

    square = {"x": ACT, "w": TensorSpec(shape=["d", "d"], init="linear_weight")}
    outputs = ["a", "b"] if fn is gated_pair else None
    forward = register(
        Block.from_torch(
            fn, name=f"{fn.__name__}_blk", inputs=square, shapes=SIZES, outputs=outputs
        )
    )
    cotangents = {o: ACT for o in forward.outputs}
    backward = backward_block(
        forward, name=f"{forward.name}_bwd", cotangents=cotangents, wrt=["x", "w"]
    )
    source = backward.reference_source()
    scope: dict = {}
    exec(compile(source, backward.name, "exec"), scope)  # noqa: S102
    inputs = backward.make_inputs(SIZES.cpu[0], torch.float32, seed=0)
    got = scope[backward.name](**inputs)
    for name, want in backward.reference(inputs).items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    assert (f"vjp({fn.__name__}, " in source) == (fn is gated_dict)
