"""Compile a generated CuTe epilogue module for a call's tensors, and launch it.

``CuteStep`` belongs to one fused GEMM step of a compiled Program. ``actions(...)`` decides
whether this call can run on the CuTe backend (every tensor laid out as TMA needs it, the epilogue
generated for these dtypes) and returns the run-plan actions that allocate the step's outputs and
launch the kernel — or raises ``CuteUnsupported`` and the step runs on Triton. Compiled kernels
are kept per signature (dtypes, which operand dimension is contiguous, tile config): the sizes are
symbolic, so one compile serves every M, N and K.

A step runs at the config tuning pinned for it (``cute.tuning``: the candidates timed on the
step's tensors). Untuned, the config is chosen by shape from what was measured on an H200
(bench/RESULTS.md, runs 2026-12-02h to j): 128 × 192 output tiles for large products (K ≥ 4096,
M·N ≥ 2²⁶), 128 × 128 otherwise, both with two consumer warpgroups in ping-pong and clusters of
two CTAs along M (clusters of one and cooperative 256 × 128 tiles were slower in every variant
measured at 8192³).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..launch import collecting
from ..run_plans import Action, Allocate
from ..settings import current
from ..types import partials_shape, torch_dtype
from .emit import CuteSource, CuteUnsupported, generate

if TYPE_CHECKING:
    from ..analysis import GemmInfo
    from ..base import RunEnv
    from ..ir import GemmEpilogue

_COMPILE_LOCK = threading.Lock()  # the DSL's compiler is not reentrant


class CuteConfig(NamedTuple):
    """How QuACK's GEMM runs a step: the CTA's output tile, the cluster of CTAs sharing A/B tile
    loads, whether two consumer warpgroups take tiles in turn (ping-pong, 128-row tiles) or
    share one (cooperative, 256-row tiles), and the epilogue's shape:

    - ``epi_stages`` 0 takes QuACK's shared-memory split, n > 0 gives the epilogue's tile stores
      and tile loads n stages each before the A/B pipeline takes the rest
      (``epilogue.CodaEpilogue``); ``epi_loads`` n > 0 gives the tile loads n stages and the tile
      stores QuACK's base; ``epi_n`` n > 0 makes the sub-tiles n columns wide (0: QuACK's) —
      these two for experiments, tuning does not time them (bench/RESULTS.md run 2026-12-04a);
    - ``epi_overlap``, the loop of a step that loads tiles (``overlap.OverlappedEpilogue``): 2,
      the default, reads each sub-tile's tile loads during the previous one's arithmetic and
      stores it after the next one's; 1 only the first; 0 QuACK's loop (run 2026-12-04c: level
      2 took the SwiGLU backward of a Llama down projection from 1.035 to 0.997 ms; 128 × 192
      tiles keep QuACK's, ``WIDE``);
    - ``dynamic``, how clusters get their tiles: False, a fixed stride through the tiles (each
      persistent cluster knows its next tile); True, the next free tile from a counter in global
      memory (an atomic increment per tile), so a cluster whose epilogues run long takes fewer
      tiles — QuACK's own choice for its gated backward GEMM on Hopper."""

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    epi_stages: int = 0
    dynamic: bool = False
    epi_loads: int = 0
    epi_n: int = 0
    epi_overlap: int = 2

    @property
    def tile(self) -> tuple[int, int]:
        return (self.tile_m, self.tile_n)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (self.cluster_m, self.cluster_n, 1)

    def __str__(self) -> str:
        kind = "pingpong" if self.pingpong else "cooperative"
        text = f"{self.tile_m}x{self.tile_n} cluster {self.cluster_m}x{self.cluster_n} {kind}"
        text += f", {self.epi_stages} epilogue stages" if self.epi_stages else ""
        text += f", {self.epi_loads} tile-load stages" if self.epi_loads else ""
        text += f", epilogue sub-tiles {self.epi_n} wide" if self.epi_n else ""
        loops = {0: ", QuACK's epilogue loop", 1: ", overlapped tile-load reads only"}
        text += loops.get(self.epi_overlap, "")
        return text + (", dynamic scheduler" if self.dynamic else "")


# 128 × 192 tiles keep QuACK's epilogue loop: with the overlapped one the two backward paper
# kernels ran 1.5–2% slower at 8192³ and 14–17% at 4096³ (bench/RESULTS.md run 2026-12-04c
# against run 2026-12-03j, two machines), where on 128 × 128 tiles it ran 2–3% faster
WIDE = CuteConfig(128, 192, epi_overlap=0)


def choose_config(gemm: GemmInfo) -> CuteConfig:
    """The config of step ``gemm`` (see the module docstring)."""
    if gemm.K >= 4096 and gemm.M * gemm.N >= 1 << 26:
        return WIDE
    return CuteConfig(128, 128)


def _tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor TMA can move: one dimension contiguous, the other's stride and the base
    address multiples of 16 bytes."""
    if t.dim() != 2 or t.data_ptr() % 16:
        return False
    size = t.element_size()
    s0, s1 = t.stride()
    return (s1 == 1 and (s0 * size) % 16 == 0) or (s0 == 1 and (s1 * size) % 16 == 0)


def _as_mk(t: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` as QuACK's ``(rows, cols, L=1)``: the strides of
    ``t.unsqueeze(0).permute(1, 2, 0)``, in one view (this runs for every tensor of every
    launch)."""
    rows, cols = t.shape
    s0, s1 = t.stride()
    return t.as_strided((rows, cols, 1), (s0, s1, s0 * rows))


@dataclass
class CuteStep:
    """The CuTe side of one fused step: generated sources by dtypes, compiled kernels by
    signature."""

    step: GemmEpilogue
    _sources: dict[tuple, CuteSource] = field(default_factory=dict)
    _compiled: dict[tuple, Any] = field(default_factory=dict)

    def source(self, gemm: GemmInfo, dtypes: dict[str, torch.dtype]) -> CuteSource:
        key = tuple(sorted((k, str(v)) for k, v in dtypes.items()))
        if key not in self._sources:
            self._sources[key] = generate(self.step, gemm, dtypes)
        return self._sources[key]

    def sources(self) -> list[CuteSource]:
        """The modules generated so far (one per set of dtypes)."""
        return list(self._sources.values())

    def plan(
        self,
        gemm: GemmInfo,
        dtypes: dict[str, torch.dtype],
        act: torch.dtype,
        config: CuteConfig | None = None,
    ) -> tuple[CuteSource, CuteConfig, tuple[tuple[str, tuple, torch.dtype], ...]]:
        """For tensors of ``dtypes`` (what the step writes aside): the generated module, the
        config it runs at (``config``, else ``choose_config``'s) and what the step allocates as
        ``(name, shape, dtype)``."""
        dtypes = {**dtypes, **{n: torch_dtype(t.dtype, act) for n, t in gemm.writes.items()}}
        source = self.source(gemm, dtypes)
        config = config or choose_config(gemm)
        writes = tuple(
            (n, *self._allocation(t, gemm, config.tile, act)) for n, t in gemm.writes.items()
        )
        return source, config, writes

    def actions(
        self,
        gemm: GemmInfo,
        tensors: dict[str, torch.Tensor],
        act: torch.dtype,
        device: torch.device,
        poison: bool,
        config: CuteConfig | None = None,
    ) -> list[Action]:
        """Allocate what the step writes and launch it at ``config`` (default: by shape,
        ``choose_config``); raises ``CuteUnsupported``."""
        a, b = self._operands(tensors)
        if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
            raise CuteUnsupported(f"operands are {a.dtype} / {b.dtype} (the CuTe GEMM is 16-bit)")
        dtypes = {n: t.dtype for n, t in tensors.items() if t.is_floating_point()}
        source, config, writes = self.plan(gemm, dtypes, act, config)
        allocate = Allocate(writes, device, poison)
        allocate(tensors, None)
        moved = [tensors[b.tensor] for b in source.bindings if b.kind in ("tile", "store")]
        if source.output is not None:
            moved.append(tensors[source.output])
        for t in (a, b, *moved):
            if not _tma_ready(t):
                raise CuteUnsupported(
                    f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} is not "
                    "16-byte aligned for TMA"
                )
        for v in (tensors[b.tensor] for b in source.bindings if b.kind in ("row", "col")):
            if not v.is_contiguous() or (v.numel() * v.element_size()) % 4 or v.data_ptr() % 4:
                raise CuteUnsupported(
                    f"a vector of {v.numel()} {v.dtype} values is not whole 32-bit words"
                )
        launch = CuteLaunch(self, source, gemm.M, gemm.N, config)
        launch(tensors, None)
        return [allocate, launch]

    def _operands(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A as ``[M, K]`` and B as QuACK takes it, ``[N, K]`` (views, no copies)."""
        a = tensors[self.step.a.tensor]
        b = tensors[self.step.b.tensor]
        a = a.T if self.step.a.transpose else a
        b = b if self.step.b.transpose else b.T
        return a, b

    @staticmethod
    def _allocation(t, gemm: GemmInfo, tile: tuple[int, int], act: torch.dtype):
        if t.partials is not None:
            p = t.partials
            if p.axis == "row":  # one partial per tile_n accumulator columns
                return partials_shape(
                    t.shape[0], p.length, tile[1] * p.length // gemm.N
                ), torch.float32
            return partials_shape(t.shape[0], p.length, tile[0]), torch.float32
        return t.shape, torch_dtype(t.dtype, act)

    def compiled(self, source: CuteSource, args: dict[str, Any], config: CuteConfig) -> Any:
        signature = (source.key, config, *((n, _signature(v)) for n, v in args.items()))
        fn = self._compiled.get(signature)
        if fn is None:
            with _COMPILE_LOCK:
                fn = self._compiled.get(signature)
                if fn is None:
                    try:
                        fn = _compile(source, args, config)
                    except Exception as e:  # the DSL's compiler refused this epilogue
                        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                        raise CuteUnsupported(f"the CuTe DSL did not compile it: {first}") from e
                    self._compiled[signature] = fn
        return fn


def _signature(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(s == 1 for s in value.stride()), value.dim())
    return (type(value).__name__,)


class CuteLaunch(Action):
    """Launch a step's CuTe kernel on a call's tensors (inside ``collected_launches``: compile
    it, launch nothing)."""

    def __init__(
        self, step: CuteStep, source: CuteSource, m: int, n: int, config: CuteConfig
    ) -> None:
        self.step, self.source, self.m, self.n, self.config = step, source, m, n, config
        self._fn: Any = None  # the compiled kernel, looked up once: a plan's replays share it
        self._counter: torch.Tensor | None = None  # the dynamic scheduler's tile counter
        self._views: tuple[_View, ...] | None = None  # how later calls view their tensors

    def __call__(self, tensors: dict[str, torch.Tensor], env: RunEnv | None) -> None:
        args = self.arguments(tensors)
        if self._fn is None:  # one run signature, one kernel signature (run_plans)
            self._fn = self.step.compiled(self.source, args, self.config)
        if collecting():
            return
        if self.config.dynamic and self._counter is None:
            # zeroed once: the kernel's atomic increments wrap back to 0 after the last tile, so
            # every later launch of this action (a replay, a CUDA graph's) finds it at 0 again
            self._counter = torch.zeros(1, dtype=torch.int32, device=args["A"].device)
        _run(self._fn, self.source, args, self.config, self._counter)

    def arguments(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The kernel's arguments in QuACK's shapes: A ``(M, K, 1)``, B ``(N, K, 1)``, D and
        every tile ``(M, N, 1)`` (pair-wide ones as 32-bit words; half-wide stores
        ``(M, N/2, 1)``), vectors ``(1, len)``, row partials ``(1, M, tiles)``, column partials
        ``(1, tiles, N)``, and the bounds.

        The first call works each view out; later calls make each in one ``as_strided`` of the
        call's tensor (of its 32-bit view for pairs) with the first call's sizes and strides: a
        launch is replayed only on tensors of its run signature (``run_plans``), whose shapes and
        strides are the first call's."""
        views = self._views
        if views is not None:
            args = {v.arg: _view_of(tensors[v.tensor], v) for v in views}
        else:
            args = self._first_arguments(tensors)
            self._views = tuple(
                _View.of(arg, name, tensors[name], args[arg]) for arg, name in self._tensors()
            )
        if self.source.output is None:
            args["D"] = None
        if self.source.uses_coords:
            args["m_bound"], args["n_bound"] = self.m, self.n
        return args

    def _tensors(self) -> list[tuple[str, str]]:
        """``(argument, tensor)`` of each tensor argument."""
        step = self.step.step
        pairs = [("A", step.a.tensor), ("B", step.b.tensor)]
        if self.source.output is not None:
            pairs.append(("D", self.source.output))
        return pairs + [(b.op, b.tensor) for b in self.source.bindings]

    def _first_arguments(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """``arguments``' tensors, each view worked out from the call's tensors."""
        a, b = self.step._operands(tensors)
        args: dict[str, Any] = {"A": _as_mk(a), "B": _as_mk(b)}
        if self.source.output is not None:
            out = tensors[self.source.output]
            args["D"] = _as_mk(out.view(torch.float32) if self.source.output_pairs else out)
        for binding in self.source.bindings:
            t = tensors[binding.tensor]
            if binding.kind in ("tile", "store"):
                args[binding.op] = _as_mk(t.view(torch.float32) if binding.pairs else t)
            elif binding.kind in ("row", "col", "row_partials"):
                args[binding.op] = t.unsqueeze(0)
            else:  # col_partials: [N, m tiles] as QuACK's (1, m tiles, N)
                args[binding.op] = t.t().unsqueeze(0)
        return args


class _View(NamedTuple):
    """How a launch argument views a call's tensor: argument name, tensor name, whether through
    its 32-bit view (pairs of 16-bit values), and the view's sizes and strides."""

    arg: str
    tensor: str
    words: bool
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, arg: str, name: str, tensor: torch.Tensor, view: torch.Tensor) -> _View:
        words = view.dtype != tensor.dtype
        return cls(arg, name, words, tuple(view.shape), view.stride())


def _view_of(t: torch.Tensor, view: _View) -> torch.Tensor:
    return (t.view(torch.float32) if view.words else t).as_strided(view.size, view.stride)


def _module(source: CuteSource) -> Any:
    """Import the generated module (written to the kernel cache, where a person can read it)."""
    name = f"coda_cute_{source.key}"
    if name in sys.modules:
        return sys.modules[name]
    directory = current().cache_dir / "cute"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    if not path.exists() or path.read_text() != source.text:
        path.write_text(source.text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _fake(value: Any, shape: tuple, tma: bool = True) -> Any:
    """A stand-in of ``value`` for compiling: its dtype and contiguous dimension, sizes and
    other strides symbolic — multiples of 16 bytes where TMA moves it, of 4 bytes otherwise
    (vectors come in 32-bit copies)."""
    import cutlass
    from quack.compile_utils import make_fake_tensor
    from quack.cute_dsl_utils import torch2cute_dtype_map

    if not isinstance(value, torch.Tensor):
        return cutlass.Int32(0)
    ones = [i for i, s in enumerate(value.stride()) if s == 1]
    leading = next((i for i in ones if value.shape[i] > 1), ones[0] if ones else None)
    dtype = torch2cute_dtype_map[value.dtype]
    divisibility = 128 // dtype.width if tma else max(1, 32 // dtype.width)
    return make_fake_tensor(dtype, shape, divisibility=divisibility, leading_dim=leading)


_TMA_KINDS = ("tile", "store")


class Sizes(NamedTuple):
    """The symbolic sizes a compile leaves open: the product's ``m``, ``n``, ``k`` and
    ``batch``, the number of tiles along N (a row's partial sums, one per N tile) and along M
    (a column's, one per M tile) — two sizes: one kernel serves shapes where they differ —
    and ``half_n``, the width of a half-tile output."""

    m: Any
    n: Any
    k: Any
    batch: Any
    n_tiles: Any
    m_tiles: Any
    half_n: Any


def argument_shapes(source: CuteSource, sizes: Sizes) -> dict[str, tuple]:
    """Each kernel argument's shape in ``sizes``, in QuACK's layouts (what ``CuteLaunch.
    arguments`` passes): A ``(m, k, batch)``, B ``(n, k, batch)``, D and every tile ``(m, n,
    batch)`` (half-wide stores ``(m, half_n, batch)``), vectors ``(batch, len)``, row partials
    ``(batch, m, n_tiles)``, column partials ``(batch, m_tiles, n)``."""
    m, n, batch = sizes.m, sizes.n, sizes.batch
    kinds = {
        "tile": (m, n, batch), "store": (m, n, batch), "row": (batch, m), "col": (batch, n),
        "row_partials": (batch, m, sizes.n_tiles), "col_partials": (batch, sizes.m_tiles, n),
    }  # fmt: skip
    shapes = {"A": (m, sizes.k, batch), "B": (n, sizes.k, batch), "D": (m, n, batch)}
    for b in source.bindings:
        shapes[b.op] = (m, sizes.half_n, batch) if b.half else kinds[b.kind]
    return shapes


def _compile(source: CuteSource, args: dict[str, Any], config: CuteConfig) -> Any:
    """Compile the module's ``Epilogue`` GEMM for tensors laid out like ``args`` (sizes
    symbolic: one compile serves every M, N, K)."""
    import cutlass.cute as cute
    from quack.gemm_tvm_ffi_utils import compile_gemm_kernel, make_fake_scheduler_args

    module = _module(source)
    sizes = Sizes(*(cute.sym_int() for _ in Sizes._fields))
    shapes = argument_shapes(source, sizes)
    mA = _fake(args["A"], shapes["A"])
    mB = _fake(args["B"], shapes["B"])
    mD = None if args["D"] is None else _fake(args["D"], shapes["D"])
    epi = {b.op: _fake(args[b.op], shapes[b.op], tma=b.kind in _TMA_KINDS) for b in source.bindings}
    if source.uses_coords:
        epi["m_bound"] = epi["n_bound"] = _fake(0, ())
    cls = _with_epi_shape(
        module.Epilogue, config.epi_stages, config.epi_loads, config.epi_n, config.epi_overlap
    )
    return compile_gemm_kernel(
        cls, mA.element_type, config.tile, config.cluster, config.pingpong, True, False, False,
        (9, 0),
        mA, mB, mD, None, cls.EpilogueArguments(**epi),
        make_fake_scheduler_args(config.dynamic, False, sizes.batch), None,
    )  # fmt: skip


@functools.cache
def _with_epi_shape(epilogue: type, stages: int, loads: int, width: int, overlap: int) -> type:
    """The generated class itself, or a subclass of it whose epilogue pipelines are ``stages``
    deep, whose tile loads ``loads`` deep, whose sub-tiles ``width`` columns wide and whose
    loop overlaps its shared-memory waits (``CodaEpilogue.epi_stages``, ``epi_loads``, ``epi_n``,
    ``epi_overlap``)."""
    if not stages and not loads and not width and not overlap:
        return epilogue
    name = f"{epilogue.__name__}E{stages}L{loads}N{width}O{int(overlap)}"
    attributes = {"epi_stages": stages, "epi_loads": loads, "epi_n": width}
    attributes["epi_overlap"] = int(overlap)
    return type(name, (epilogue,), attributes)


@functools.cache
def _max_clusters(device_index: int, cluster_size: int) -> int:
    """How many clusters of ``cluster_size`` CTAs are resident at once on a device."""
    from quack.cute_dsl_utils import get_max_active_clusters

    return get_max_active_clusters(cluster_size)


@functools.cache
def _scheduler(device_index: int, cluster_size: int) -> Any:
    """The static persistent tile scheduler's arguments on a device (as many clusters as fit)."""
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    return make_scheduler_args(_max_clusters(device_index, cluster_size), 8, None)


def _scheduler_args(device_index: int, cluster_size: int, counter: torch.Tensor | None) -> Any:
    """The tile scheduler's arguments: static, or dynamic on the tile counter ``counter``."""
    if counter is None:
        return _scheduler(device_index, cluster_size)
    from quack.gemm_tvm_ffi_utils import make_scheduler_args

    return make_scheduler_args(_max_clusters(device_index, cluster_size), 8, counter)


@functools.lru_cache(maxsize=1024)
def _int32(value: int) -> Any:
    """``cutlass.Int32(value)``, made once per value (a few microseconds each: a launch's bounds
    are the same on every replay)."""
    import cutlass

    return cutlass.Int32(value)


def _run(
    fn: Any,
    source: CuteSource,
    args: dict[str, Any],
    config: CuteConfig,
    counter: torch.Tensor | None = None,
) -> None:
    module = sys.modules[f"coda_cute_{source.key}"]
    epi = {b.op: args[b.op] for b in source.bindings}
    if source.uses_coords:
        epi["m_bound"], epi["n_bound"] = _int32(args["m_bound"]), _int32(args["n_bound"])
    cluster_size = config.cluster_m * config.cluster_n
    sched = _scheduler_args(args["A"].device.index or 0, cluster_size, counter)
    fn(args["A"], args["B"], args["D"], None, module.Epilogue.EpilogueArguments(**epi), sched, None)
