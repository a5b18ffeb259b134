"""The MLP drop-in for Hugging Face Llama layers, running CODA Programs forward and backward.

``CodaLlamaMLPBlock(norm, mlp)`` replaces the MLP half of a ``LlamaDecoderLayer`` —
``x + mlp(post_attention_layernorm(x))`` — with the two fused forward kernels and the fused backward
of ``llama_mlp`` / ``llama_mlp_bwd``. It shares the Hugging Face modules' parameters (nothing is
copied), so optimizers, state dicts and weight tying see the same tensors, and their ``.grad``s are
filled by the backward Program.

``fuse_gate_up=True`` instead moves ``gate_proj.weight`` and ``up_proj.weight`` into one parameter
of interleaved rows, ``gate_up_weight`` ``[2f, d]`` — the layout the fused kernels read and the
fused weight-gradient GEMM writes — so a training step moves no weight layouts at all (build the
optimizer after wrapping). State dicts keep Hugging Face's keys both ways.

Where an MLP keeps its gate and up weights is a ``GateUpLayout``: ``SEPARATE_GATE_UP``
(Llama's ``gate_proj`` + ``up_proj``) or ``CONCATENATED_GATE_UP`` (Phi-3's ``gate_up_proj``
``[2f, d]``, gate rows first): the kernels read row views of the one weight, so it stays one
Parameter and its gradient is the two views' gradients in place.

Which kernels compute an MLP half is an ``MLPKernel``: its GLU activation, its norm's offset and
whether a post-norm follows the down projection — ``LLAMA_MLP`` (SwiGLU under Llama's RMSNorm:
``llama_mlp``), ``GEMMA_MLP`` (GeGLU ``gelu_tanh`` under Gemma's ``x̂ · (1 + w)``: ``gemma_mlp``)
and ``GEMMA2_MLP`` (the same between Gemma 2/3's sandwich norms: ``gemma2_mlp_branch``, whose
post-norm weight the block takes as ``post_norm``), and ``OLMO2_MLP`` (SwiGLU with no pre-norm,
then OLMo 2's post-norm ``w · x̂``: ``olmo2_mlp_branch``). ``mlp_kernel(act, offset)`` finds one.

Also here, for ``patch_llama``'s ``CodaLlamaMLP``: ``llama_mlp_function`` (the exported op),
``check_llama_mlp``, ``interleave_gate_up`` and ``keep_hf_gate_up_keys``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from coda.primitives.prep.layout import interleave_rows

from .autograd import ExportedFunction, PackedRows, Tuning, export_autograd
from .checks import GEMMA_OFFSET, check_plain_linear, rms_norm_form
from .dtypes import autocast_dtype, run_in_dtype
from .programs import FAMILIES
from .resolve import dropin_programs

GATE_UP = PackedRows("w_gate_up", even="w_gate", odd="w_up")


@dataclass(frozen=True)
class MLPKernel:
    """The shipped block families that compute one form of MLP half: ``act`` (the GLU's
    activation, as ``activation_name`` names it) under an RMSNorm of ``offset`` (0: Llama's
    ``x̂ · w``; 1: Gemma's ``x̂ · (1 + w)``), followed by a post-norm of the same form when
    ``post_norm``. ``residual``: the family with the residual add in its kernels (None: only the
    branch is shipped, for layers that add it themselves); ``branch``: the one without.
    ``pre_norm``: whether the MLP's input is normalized first (not in OLMo 2's, whose only norm
    is the post-norm: ``offset`` is then that norm's)."""

    name: str
    act: str
    offset: float
    residual: str | None
    branch: str
    post_norm: bool = False
    pre_norm: bool = True

    def family(self, residual: bool) -> str:
        """The block family for a block built with or without its residual add."""
        if residual and self.residual is None:
            raise ValueError(
                f"the {self.name} kernels compute the MLP branch only (a post-norm follows the "
                "down projection; the layer adds the residual): build the block with "
                "residual=False"
            )
        return self.residual if residual else self.branch  # type: ignore[return-value]


ACTIVATION_NAMES = {"silu": "SiLU", "gelu": "GELU", "gelu_tanh": "tanh-GELU", "relu": "ReLU"}
LLAMA_MLP = MLPKernel("llama_mlp", "silu", 0.0, "llama_mlp", "llama_mlp_branch")
GEMMA_MLP = MLPKernel("gemma_mlp", "gelu_tanh", GEMMA_OFFSET, "gemma_mlp", "gemma_mlp_branch")
GEMMA2_MLP = MLPKernel(
    "gemma2_mlp_branch", "gelu_tanh", GEMMA_OFFSET, None, "gemma2_mlp_branch", post_norm=True
)
OLMO2_MLP = MLPKernel(
    "olmo2_mlp_branch", "silu", 0.0, None, "olmo2_mlp_branch", post_norm=True, pre_norm=False
)
MLP_KERNELS = (LLAMA_MLP, GEMMA_MLP, GEMMA2_MLP, OLMO2_MLP)


def mlp_kernel(
    act: str | None, offset: float, *, post_norm: bool = False, pre_norm: bool = True
) -> MLPKernel:
    """The ``MLPKernel`` for a GLU of activation ``act`` under a norm of ``offset`` (and a
    post-norm after the down projection, ``post_norm``; without the norm before it, ``pre_norm``
    False: ``offset`` is the post-norm's); ``ValueError`` naming the shipped combinations when
    none computes it."""
    for kernel in MLP_KERNELS:
        form = (kernel.act, kernel.offset, kernel.post_norm, kernel.pre_norm)
        if form == (act, offset, post_norm, pre_norm):
            return kernel
    shipped = "; ".join(_describe(k) for k in MLP_KERNELS)
    what = _describe(MLPKernel("", act or "", offset, None, "", post_norm, pre_norm))
    raise ValueError(f"no shipped kernel computes {what}; shipped: {shipped}")


def _describe(kernel: MLPKernel) -> str:
    norm = "x̂ · (1 + w)" if kernel.offset else "x̂ · w"
    post = f", then a post-norm {norm}" if kernel.post_norm else ""
    under = f"under an RMSNorm {norm}" if kernel.pre_norm else "without a pre-norm"
    named = f" ({kernel.name})" if kernel.name else ""
    if not kernel.act:
        known = ", ".join(ACTIVATION_NAMES.values())
        return f"a GLU MLP whose gate activation is none of {known} {under}{post}"
    act = ACTIVATION_NAMES.get(kernel.act, kernel.act)
    return f"a {act} GLU MLP {under}{post}{named}"


def llama_mlp_function(
    eps: float,
    *,
    verify: bool = False,
    saved: bool = True,
    tune: Tuning = "quick",
    packed_gate_up: bool = False,
    residual: bool = True,
    kernel: MLPKernel = LLAMA_MLP,
) -> ExportedFunction:
    """``f(x, gamma, w_gate, w_up, w_down) -> out`` with autograd, for an RMSNorm epsilon.

    ``kernel``: which MLP half (``LLAMA_MLP`` by default; ``GEMMA_MLP`` for Gemma's GeGLU under
    its ``(1 + w)`` norm, ``gamma`` then the norm's own weight; ``GEMMA2_MLP``, a branch only,
    takes the post-norm's weight last: ``f(x, gamma, w_gate, w_up, w_down, gamma_post)``).

    ``residual=False``: ``out`` is the MLP branch alone, without ``x +`` (the
    ``llama_mlp_branch`` blocks), for a caller that adds the residual in another dtype.

    ``packed_gate_up``: ``f(x, gamma, w_gate_up, w_down)`` instead, ``w_gate_up = [2f, d]`` with
    ``gate_proj``'s rows at even and ``up_proj``'s at odd indices (``interleave_gate_up``); its
    gradient comes back in the same layout, as the backward's weight-gradient GEMM writes it.

    ``saved`` (default): the forward is ``llama_mlp_train``, which also keeps the gate and up
    projections and the SwiGLU output, and the backward ``llama_mlp_bwd_saved`` uses them
    (docs/algebra.md §7's schedule) — and a call that needs no gradient (``torch.no_grad()``,
    nothing requiring grad) runs the plain ``llama_mlp`` forward instead, storing none of them;
    otherwise the forward stores nothing extra and ``llama_mlp_bwd`` recomputes the gate/up GEMM
    (less memory, one more GEMM). The Programs are the built-in planner's, checked to be the
    shipped verified ones (``coda.export.programs``; milliseconds); with ``verify`` each is
    verified by the sandbox at the block's shape sets instead (seconds; once per process).
    ``tune``: how mainloop configs are tuned for each new shape on a GPU (``export_autograd``).
    """
    function = _llama_mlp_function(eps, verify, saved, packed_gate_up, kernel.family(residual))
    function.tune = tune
    return function


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """``[2f, d]``: ``w_gate``'s rows at even indices, ``w_up``'s at odd (a new tensor), the
    layout of ``llama_mlp_function(packed_gate_up=True)``'s ``w_gate_up``."""
    return interleave_rows(w_gate, w_up)


@lru_cache(maxsize=16)
def _llama_mlp_function(
    eps: float, verify: bool, saved: bool, packed: bool, name: str
) -> ExportedFunction:
    # Saving g and u for the backward: without gradients (evaluation, no_grad) the plain forward
    # runs instead and stores none of them.
    keys = ["train", "backward_saved", "forward"] if saved else ["forward", "backward"]
    programs = dropin_programs(name, keys, eps, verify=verify)
    return export_autograd(
        programs[0],
        programs[1],
        FAMILIES[name].blocks(eps)[keys[1]],
        packed=[GATE_UP] if packed else [],
        inference=programs[2] if saved else None,
    )


def check_llama_mlp(mlp: nn.Module, kernel: MLPKernel = LLAMA_MLP) -> None:
    """``ValueError`` unless ``mlp`` computes what the ``kernel`` blocks do (by default
    llama_mlp's): bias-free gate, up and down projections (modules with a 2-D ``weight``) and
    the kernel's gate activation (SiLU). A module without them (a mixture of experts, a fused
    ``gate_up_proj``, a two-matrix MLP) is refused by name."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        module = getattr(mlp, proj, None)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"mlp ({type(mlp).__name__}) has no {proj} with a 2-D weight; the {kernel.name} "
                f"block computes down_proj({kernel.act}(gate_proj(x)) · up_proj(x))"
            )
        if getattr(module, "bias", None) is not None:
            raise ValueError(f"mlp.{proj} has a bias; the {kernel.name} block has none")
        check_plain_linear(module, f"mlp.{proj}")
    _check_activation(mlp, "act_fn", kernel)


def _check_activation(mlp: nn.Module, attr: str, kernel: MLPKernel) -> None:
    """``ValueError`` unless ``mlp.<attr>`` computes ``kernel``'s gate activation."""
    want = ACTIVATION_NAMES[kernel.act]
    if not hasattr(mlp, attr):
        raise ValueError(
            f"mlp ({type(mlp).__name__}) has no {attr}; the {kernel.name} block uses {want}"
        )
    act = getattr(mlp, attr)
    if activation_name(act) != kernel.act:
        raise ValueError(
            f"mlp.{attr} is {act!r}{_glu_kind(act, kernel)}; the {kernel.name} block uses {want}"
        )


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


def activation_name(act: Any) -> str | None:
    """Which of SiLU, GELU, tanh-GELU and ReLU ``act`` computes (probed on [-4, 4]), or None."""
    probe = torch.linspace(-4, 4, 17)
    try:
        got = act(probe)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a probe is none of them
        return None
    for name, fn in _ACTIVATIONS.items():
        if isinstance(got, torch.Tensor) and torch.allclose(got, fn(probe), atol=1e-6):
            return name
    return None


def check_concatenated_mlp(mlp: nn.Module, kernel: MLPKernel = LLAMA_MLP) -> None:
    """``ValueError`` unless ``mlp`` is a Phi-3-style GLU MLP: a bias-free ``gate_up_proj``
    with a 2-D weight of ``2f`` rows, a bias-free ``down_proj`` of ``f`` columns and
    ``kernel``'s gate activation as ``activation_fn`` (SiLU; which rows are the gate is proven
    on the probe forward, not here)."""
    gate_up = getattr(getattr(mlp, "gate_up_proj", None), "weight", None)
    down = getattr(getattr(mlp, "down_proj", None), "weight", None)
    for proj, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(
                f"mlp ({type(mlp).__name__}) has no {proj} with a 2-D weight; the {kernel.name} "
                f"block computes down_proj({kernel.act}(gate) · up) with [gate; up] = "
                "gate_up_proj(x)"
            )
        if getattr(getattr(mlp, proj), "bias", None) is not None:
            raise ValueError(f"mlp.{proj} has a bias; the {kernel.name} block has none")
        check_plain_linear(getattr(mlp, proj), f"mlp.{proj}")
    if gate_up.shape[0] != 2 * down.shape[1]:
        raise ValueError(
            f"mlp.gate_up_proj has {gate_up.shape[0]} rows, not twice down_proj's "
            f"{down.shape[1]} input features: not a concatenated [gate; up] weight"
        )
    _check_activation(mlp, "activation_fn", kernel)


def _glu_kind(act: Any, kernel: MLPKernel) -> str:
    """What a GELU-gated MLP is, when ``kernel`` computes another: `` (a GeGLU MLP: ...)``
    naming the kernels for it (Gemma's tanh-GELU) or saying none is shipped; else nothing."""
    name = activation_name(act)
    if name not in ("gelu", "gelu_tanh") or name == kernel.act:
        return ""
    if name == GEMMA_MLP.act:
        return (
            " (a GeGLU MLP: the gemma_mlp kernels compute it under Gemma's (1 + w) norm; "
            "patch_model patches it)"
        )
    return " (a GeGLU MLP with exact GELU: no shipped kernel computes it yet)"


def _separate_gate_up(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return mlp.gate_proj.weight, mlp.up_proj.weight


def _concatenated_gate_up(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    weight = mlp.gate_up_proj.weight
    f = weight.shape[0] // 2
    return weight[:f], weight[f:]


@dataclass(frozen=True)
class GateUpLayout:
    """Where an MLP module keeps its gate and up weights: ``check(mlp, kernel)`` raises
    ``ValueError`` unless ``mlp`` has this layout and computes ``kernel``'s GLU (by default
    SwiGLU); ``split(mlp)`` returns ``(w_gate,
    w_up)``, each ``[f, d]`` (the Parameters themselves or row views of one, so gradients reach
    the module's own Parameters); ``weights`` names the module's weight keys."""

    name: str
    check: Callable[..., None]
    split: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]]
    weights: tuple[str, ...]


SEPARATE_GATE_UP = GateUpLayout(
    "gate_proj + up_proj", check_llama_mlp, _separate_gate_up, ("gate_proj", "up_proj")
)
CONCATENATED_GATE_UP = GateUpLayout(
    "gate_up_proj = [gate; up]", check_concatenated_mlp, _concatenated_gate_up, ("gate_up_proj",)
)


def _check_one_requires_grad(gate: torch.Tensor, up: torch.Tensor) -> None:
    """``ValueError`` unless the gate and up weights agree on ``requires_grad``: fused, they are
    one parameter with one flag, which would train a frozen one or freeze a trained one."""
    if gate.requires_grad != up.requires_grad:
        raise ValueError(
            f"fuse_gate_up: mlp.gate_proj.weight has requires_grad={gate.requires_grad} and "
            f"mlp.up_proj.weight requires_grad={up.requires_grad}; fused into one parameter they "
            "would share one flag — freeze or train both, or patch without fuse_gate_up"
        )


class CodaLlamaMLPBlock(nn.Module):
    """``x + mlp(norm(x))`` for a Hugging Face ``LlamaRMSNorm`` + ``LlamaMLP``, on CODA kernels.

    ``norm`` is the layer's ``post_attention_layernorm`` and ``mlp`` its ``mlp``; both are kept as
    submodules (parameters shared). ``x`` is ``[..., hidden]``; the parameters must have ``x``'s
    dtype (the kernels run in one dtype) — except under ``torch.autocast`` with activations in
    another dtype (Hugging Face's mixed precision: fp32 weights and residual stream, bf16
    GEMMs), where, like the original modules, the weights and ``x`` are cast to the autocast
    dtype for the MLP branch (``llama_mlp_branch``) and the residual is added in ``x``'s dtype;
    gradients reach the parameters in their own dtype. ``verify``: verify the Programs in the
    sandbox when the module is built (once per process and epsilon) rather than use the shipped
    verified ones (default; ``coda.export.programs``). ``saved``: keep the
    gate and up projections and the SwiGLU output from the forward for the backward (default,
    docs/algebra.md §7), or recompute them in the backward (three ``[tokens, intermediate]`` tensors
    less memory, one GEMM more).
    ``tune``: mainloop configs tuned per new shape on a GPU — ``quick`` (default), ``full``,
    ``off`` (``export_autograd``).
    ``fuse_gate_up``: move ``mlp.gate_proj.weight`` and ``mlp.up_proj.weight`` into one new
    parameter ``gate_up_weight`` (``[2f, d]``, gate rows even, up rows odd) that the kernels read
    and whose gradient the backward writes as is — no per-step interleaving or gradient split.
    The two projections then hold no weight (``gate_weight``/``up_weight`` are views of it);
    ``state_dict``/``load_state_dict`` still use Hugging Face's keys. Create the optimizer
    after wrapping: the old parameters are no longer used. The two must agree on
    ``requires_grad`` (one parameter, one flag; ``ValueError`` otherwise). ``fuse_now=False``
    leaves the move to ``fuse_weights()``, for a caller that builds every layer's block before it
    changes any module (``patch_llama``, ``patch_model``).
    ``residual=False``: compute ``mlp(norm(x))`` alone (``llama_mlp_branch``), for a caller that
    adds the residual itself — a Hugging Face decoder layer does (``coda.export.patch_llama``).
    Under autocast the branch then comes back in the autocast dtype, like ``LlamaMLP``'s output.
    ``layout``: where ``mlp`` keeps its gate and up weights (``SEPARATE_GATE_UP``, Llama's, or
    ``CONCATENATED_GATE_UP``, Phi-3's ``gate_up_proj`` read as two row views; ``fuse_gate_up``
    needs the separate layout).

    Which kernels run (``kernel``, an ``MLPKernel``) follows from the modules: ``mlp``'s gate
    activation (SiLU, or Gemma's tanh-GELU) and ``norm``'s form (Llama's ``x̂ · w`` or Gemma's
    ``x̂ · (1 + w)``, whose weight the kernels read as it is). ``post_norm``: a norm of the MLP's
    output (Gemma 2/3's ``post_feedforward_layernorm``, of the same form and epsilon as
    ``norm``), also in the kernels — ``post_norm(mlp(norm(x)))``, a branch only
    (``residual=False``); its weight is the last of ``weights()``. ``norm`` None: no pre-norm
    (OLMo 2's MLP half, ``post_norm(mlp(x))`` with its ``post_feedforward_layernorm``: the
    ``olmo2_mlp_branch`` kernels); ``weights()`` then starts with the gate and up weights.
    """

    def __init__(
        self,
        norm: nn.Module | None,
        mlp: nn.Module,
        *,
        verify: bool = False,
        saved: bool = True,
        tune: Tuning = "quick",
        fuse_gate_up: bool = False,
        residual: bool = True,
        layout: GateUpLayout = SEPARATE_GATE_UP,
        post_norm: nn.Module | None = None,
        fuse_now: bool = True,
    ) -> None:
        super().__init__()
        eps, self.kernel = mlp_half_kernel(norm, mlp, post_norm)
        layout.check(mlp, self.kernel)
        if fuse_gate_up and layout is not SEPARATE_GATE_UP:
            raise ValueError(
                f"fuse_gate_up interleaves separate gate_proj and up_proj weights; this MLP "
                f"keeps them as {layout.name} — build the block without fuse_gate_up"
            )
        if fuse_gate_up:
            _check_one_requires_grad(mlp.gate_proj.weight, mlp.up_proj.weight)
        self.norm, self.mlp, self.layout, self.post_norm = norm, mlp, layout, post_norm
        self.fused, self.residual = fuse_gate_up, residual
        self._function_args = {"eps": eps, "verify": verify, "saved": saved, "kernel": self.kernel}
        # Resolved here, not in forward: torch.compile then sees only the custom op. fp32
        # parameters are master weights for autocast (or fp32 kernels): the branch is resolved
        # for autocast too. (Before fusing: a Program that fails verification leaves the Hugging
        # Face modules as they were.)
        self.function = self._resolve_function(tune, residual=residual)
        self.branch_function: ExportedFunction | None = None if residual else self.function
        if residual and any(p.dtype == torch.float32 for p in self.parameters()):
            self.branch_function = self._resolve_function(tune, residual=False)
        if fuse_gate_up and fuse_now:
            self.fuse_weights()

    def _resolve_function(self, tune: Tuning, residual: bool = True) -> ExportedFunction:
        return llama_mlp_function(
            **self._function_args, tune=tune, packed_gate_up=self.fused, residual=residual
        )

    # The exported functions hold process-wide registered ops, which neither pickle nor copy:
    # copies (copy.deepcopy, torch.save) carry how to resolve them and resolve them again.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tune"] = state.pop("function").tune
        state["_branch"] = state.pop("branch_function") is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        tune, branch = state.pop("_tune"), state.pop("_branch")
        super().__setstate__(state)
        self.function = self._resolve_function(tune, residual=self.residual)
        self.branch_function = None
        if branch:
            self.branch_function = (
                self._resolve_function(tune, residual=False) if self.residual else self.function
            )

    # -- the fused gate/up parameter -------------------------------------------------------------
    _HF_KEYS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")

    def fuse_weights(self) -> None:
        """Move the gate and up weights into ``gate_up_weight`` (a block built with
        ``fuse_gate_up`` and ``fuse_now=False``); once — nothing for a block that holds them
        already or was built without ``fuse_gate_up``."""
        if not self.fused or "gate_up_weight" in self._parameters:
            return
        gate, up = self.mlp.gate_proj, self.mlp.up_proj
        with torch.no_grad():
            fused = interleave_gate_up(gate.weight, up.weight)
        self.gate_up_weight = nn.Parameter(fused, requires_grad=gate.weight.requires_grad)  # = up's
        del gate.weight, up.weight
        keep_hf_gate_up_keys(self)

    @property
    def gate_weight(self) -> torch.Tensor:
        """``gate_proj``'s weight ``[f, d]`` (a view of ``gate_up_weight`` when fused)."""
        return self.gate_up_weight[0::2] if self.fused else self.layout.split(self.mlp)[0]

    @property
    def up_weight(self) -> torch.Tensor:
        """``up_proj``'s weight ``[f, d]`` (a view of ``gate_up_weight`` when fused)."""
        return self.gate_up_weight[1::2] if self.fused else self.layout.split(self.mlp)[1]

    def weights(self) -> list[torch.Tensor]:
        """What the kernels read besides ``x``: γ, the gate and up weights (or the fused one),
        the down weight (and the post-norm's weight, with a ``post_norm``)."""
        gate_up = [self.gate_up_weight] if self.fused else [*self.layout.split(self.mlp)]
        pre = [] if self.norm is None else [self.norm.weight]
        post = [] if self.post_norm is None else [self.post_norm.weight]
        return [*pre, *gate_up, self.mlp.down_proj.weight, *post]

    def forward(self, x: torch.Tensor, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``x + mlp(norm(x))`` (or the branch alone, built with ``residual=False``) with
        ``weights`` as ``weights()`` lists them (default: this block's own) — a caller whose
        model owns the parameters passes them as its modules hold them at this call."""
        weights = self.weights() if weights is None else weights
        flat = x.reshape(-1, x.shape[-1])
        amp = autocast_dtype(x, weights)
        if amp is not None:
            return _shaped(self._autocast_forward(flat, weights, amp), x.shape)
        return _shaped(self.function(flat, *weights), x.shape)

    def branch(self, x: torch.Tensor, weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``mlp(norm(x))`` alone — what ``forward`` computes with ``residual=False`` — from a
        block built either way (one built with ``residual=True`` resolves the branch Programs
        on first use, unless it already has them for autocast); ``weights`` as ``forward``'s."""
        if not self.residual:
            return self(x, weights)
        weights = self.weights() if weights is None else weights
        dtype = autocast_dtype(x, weights) or x.dtype
        return _shaped(self._run_branch(x.reshape(-1, x.shape[-1]), weights, dtype), x.shape)

    def _autocast_forward(
        self, x: torch.Tensor, weights: list[torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """What the Hugging Face modules do under autocast: the projections (and here the whole
        MLP branch, norm included) in ``dtype``, ``x + branch`` in ``x``'s dtype (or the branch
        alone, in ``dtype``)."""
        branch = self._run_branch(x, weights, dtype)
        return x + branch if self.residual else branch

    def _run_branch(
        self, x: torch.Tensor, weights: list[torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """The branch Programs on ``x`` ``[tokens, d]`` in ``dtype`` (resolved on first use)."""
        if self.branch_function is None:
            self.branch_function = _resolve_branch(self)
        return run_in_dtype(self.branch_function, dtype, x, *weights)


def mlp_activation(mlp: nn.Module) -> str | None:
    """The name of ``mlp``'s gate activation (``act_fn``, or Phi-3's ``activation_fn``) as
    ``activation_name`` gives it, or None."""
    return activation_name(getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None)))


def mlp_half_kernel(
    norm: nn.Module | None, mlp: nn.Module, post_norm: nn.Module | None = None
) -> tuple[float, MLPKernel]:
    """``(eps, kernel)``: the norm's epsilon and the ``MLPKernel`` that computes
    ``[post_norm](mlp(norm(x)))`` for these modules' activation and norm form (``norm`` None:
    ``post_norm(mlp(x))``, the post-norm's); ``ValueError`` naming what differs (a norm that is
    no RMSNorm, post- and pre-norm of other forms or epsilons, a combination no kernel
    computes)."""
    act = mlp_activation(mlp)
    if norm is None:
        if post_norm is None:
            raise ValueError("an MLP half without a pre-norm needs its post-norm (OLMo 2's)")
        eps, offset = rms_norm_form(post_norm, "post_norm")
        try:
            return eps, mlp_kernel(act, offset, post_norm=True, pre_norm=False)
        except ValueError as e:
            raise ValueError(f"mlp ({type(mlp).__name__}) without a pre-norm: {e}") from e
    eps, offset = rms_norm_form(norm, "norm")
    if post_norm is not None:
        post = rms_norm_form(post_norm, "post_norm")
        if post != (eps, offset):
            raise ValueError(
                f"post_norm (eps {post[0]:g}, offset {post[1]:g}) and norm (eps {eps:g}, offset "
                f"{offset:g}) differ; the {GEMMA2_MLP.name} kernels apply one RMSNorm form twice"
            )
    try:
        return eps, mlp_kernel(act, offset, post_norm=post_norm is not None)
    except ValueError as e:
        raise ValueError(
            f"mlp ({type(mlp).__name__}) under norm ({type(norm).__name__}): {e}"
        ) from e


def _shaped(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``out`` ``[tokens, d]`` (a tensor computed for this call, which nothing else holds) in
    ``shape``, as a tensor of its own rather than a view — as ``torch.matmul`` returns a
    ``Linear``'s 3-D output: FSDP2 warns when a layer returns a view (an in-place op on one
    would drop the hook it registers on the layer's output)."""
    return torch.ops.aten._unsafe_view(out, shape)


@torch.compiler.disable
def _resolve_branch(block: CodaLlamaMLPBlock) -> ExportedFunction:
    """The branch function for a block built without fp32 parameters and met under autocast
    later (verification and op registration stay out of torch.compile's graph)."""
    return block._resolve_function(block.function.tune, residual=False)


def keep_hf_gate_up_keys(module: nn.Module) -> None:
    """State dicts of ``module`` (which holds ``gate_up_weight``) use Hugging Face's two keys,
    ``module._HF_KEYS`` (relative to the module), both ways."""
    module.register_state_dict_post_hook(_state_dict_with_hf_keys)
    module.register_load_state_dict_pre_hook(_load_hf_keys)


def _state_dict_with_hf_keys(
    module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any
) -> None:
    """``gate_up_weight`` saved as Hugging Face's two weights (contiguous copies)."""
    fused = state.pop(prefix + "gate_up_weight").detach()  # keep_vars=True: no autograd copy
    gate, up = (prefix + k for k in module._HF_KEYS)
    state[gate], state[up] = fused[0::2].contiguous(), fused[1::2].contiguous()


def _load_hf_keys(module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
    """Hugging Face's gate and up weights loaded into ``gate_up_weight``."""
    gate, up = (prefix + k for k in module._HF_KEYS)
    if gate in state and up in state:
        state[prefix + "gate_up_weight"] = interleave_gate_up(state.pop(gate), state.pop(up))
