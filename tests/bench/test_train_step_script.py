"""bench/train_step.py (and bench/llama_train_step.py, its Llama entry): it fails fast without a
GPU, and its dry run (CPU, toy models) runs every code path of the GPU run — every family,
patched and compiled variants, both settings, the correctness check against Hugging Face's own
step, runs, idle-gap profiles, tables and result files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.bench import load_script

pytest.importorskip("transformers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU message")
@pytest.mark.parametrize("script", ["train_step", "llama_train_step"])
def test_fails_fast_without_a_gpu(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert load_script(script).main(["--out", str(tmp_path)]) == 2
    assert f"{script}.py needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_dry_run_checks_every_variant_against_hugging_face(tmp_path: Path) -> None:
    variants = "hf,coda_mlp,coda,coda_fused,coda_lm_head,coda_lm_head_decide,coda_lm_head_ops"
    variants += ",coda_lm_head_triton,coda_compile,coda_lm_head_graph"  # (a graph is GPU-only:
    # the plain step here)
    argv = ["--dry-run", "--out", str(tmp_path), "--variants", variants, "--sync-check"]
    argv += ["--host", "--host-split", "--cprofile", "coda_lm_head", "--memory-peak"]
    assert load_script("llama_train_step").main(argv) == 0  # the Llama entry, as recorded
    result = json.loads((tmp_path / "llama_train_step.json").read_text())
    rows = result["rows"]
    assert all("memory_peak" in r and r["memory_peak"] is None for r in rows)  # CPU: none
    assert [(r["setting"], r["variant"]) for r in rows] == [
        (s, v) for s in ("bf16", "amp") for v in variants.split(",")
    ]
    assert all(r["correct"] and r["step_ms"] > 0 and r["host_ms"] > 0 for r in rows)
    assert all(r["host_ms_back_to_back"] > 0 for r in rows)
    split = [r for r in rows if r["variant"].startswith("coda")]  # their launches stubbed too
    assert all(r["host_ms_no_launches"] > 0 for r in split)
    assert not any("host_ms_no_launches" in r for r in rows if r not in split)
    assert all(r["syncs"] is None for r in rows)  # GPU only: not measured in a dry run
    script = load_script("train_step")
    graphs = [r for r in rows if r["variant"].endswith("_graph")]
    assert graphs and all(r["graph"] == script.GRAPH_ON_CPU for r in graphs)
    assert not any("graph" in r for r in rows if r not in graphs)
    text = (tmp_path / "llama_train_step.md").read_text()
    assert f"amp coda_lm_head_graph: {script.GRAPH_ON_CPU}" in text  # says it is the plain step
    for setting in ("bf16", "amp"):  # the patched step's host hot spots, by cumulative time
        profile = (tmp_path / f"cprofile-{setting}-coda_lm_head.txt").read_text()
        assert "profiled steps: 1" in profile and "cumulative" in profile
        assert "causal_lm_loss" in profile
    assert not list(tmp_path.glob("cprofile-*-hf.txt"))
    from coda.export import autograd
    from coda.primitives import launch, runtime

    # coda_lm_head_decide, coda_lm_head_ops and coda_lm_head_triton switched them back
    assert autograd.EAGER_CALLS and launch.DIRECT and runtime.REPLAY
    assert runtime.BACKEND is None
    assert launch._run.__name__ == "_run"  # --host-split put the relaunch back
    assert result["model"]["num_hidden_layers"] == 2
    assert "DRY RUN" in (tmp_path / "llama_train_step.md").read_text()


def test_a_variants_module_patches_apply_only_inside_its_own_forward() -> None:
    """Liger's patch also reassigns globals of ``modeling_llama`` (its RoPE), which every other
    variant in the process would then run; contained, the patched model's forward sees them and
    nothing else does, even when its forward raises."""
    import types

    script = load_script("train_step")
    module = types.ModuleType("fake_modeling")
    module.rope = lambda: "hf"

    class Model(torch.nn.Module):
        def forward(self, fail: bool = False) -> tuple[str, bool]:
            if fail:
                raise ValueError("boom")
            return module.rope(), hasattr(module, "extra")

    def apply() -> None:
        module.rope = lambda: "liger"
        module.extra = 1

    model = script.contained_module_patches(Model(), module, apply)
    assert module.rope() == "hf" and not hasattr(module, "extra")
    assert model() == ("liger", True)
    assert module.rope() == "hf" and not hasattr(module, "extra")
    with pytest.raises(ValueError, match="boom"):
        model(fail=True)
    assert module.rope() == "hf" and not hasattr(module, "extra")
    untouched = Model()
    assert script.contained_module_patches(untouched, module, lambda: None) is untouched


# Kernel names as torch.profiler reported them in the H200 train-step profiles (2026-12-01a;
# the γ fold's kernel, then ``_scale_columns_kernel``, is ``_assemble_rows_kernel`` since).
PROFILED = {
    "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "cuBLAS GEMMs",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "cuBLAS GEMMs",
    "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>": "cuBLAS GEMMs",
    # PyTorch's own flash and memory-efficient attention are CUTLASS templates, not GEMMs
    "fmha_cutlassB_bf16_aligned_64x64_k64_seqaligned_sm80(PyTorchMemEffAttention::": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel": (
        "attention"
    ),
    "gate_up_kernel": "CODA fused GEMMs",
    "lm_head_dx_kernel": "CODA fused GEMMs",
    "q_k_v_kernel": "CODA fused GEMMs",
    "_rope_rows_kernel": "CODA aux + prep",
    "_assemble_rows_kernel": "CODA aux + prep",
    "_rstd_kernel": "CODA aux + prep",
    "_swiglu_backward_kernel": "Liger Triton",
    "liger_cross_entropy_kernel": "Liger Triton",
    "_triton_rope": "Liger Triton",
    "triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_2": "inductor Triton",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
    "void cudnn::fusion::fmha_reduce_head<true>(void const*, void*)": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::": "AdamW",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::na": (
        "copies, cat, gather"
    ),
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*)": (
        "copies, cat, gather"
    ),
    "Memcpy DtoD (Device -> Device)": "copies, cat, gather",
    "void at::native::(anonymous namespace)::sum_and_scatter<c10::BFloat16, long>": (
        "embedding backward"
    ),
    "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<": (
        "embedding backward"
    ),
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<": "other",
    "Memset (Device)": "other",
}


def test_profiled_kernels_fall_into_their_families() -> None:
    script = load_script("train_step")
    small = script.coda_small_kernels()
    # every aux / prep kernel of the package, read from it
    assert {"_rstd_kernel", "_combine_kernel", "_rope_rows_kernel", "_gather_dot_kernel",
            "_assemble_rows_kernel"} <= small  # fmt: skip
    assert {script.kernel_family(n, small) for n in small} == {"CODA aux + prep"}
    for name, family in PROFILED.items():
        assert script.kernel_family(name, small) == family, name
    kernels = [{"kernel": n, "calls": 1, "ms": 0.5} for n in PROFILED]
    families = script.kernel_families(kernels)
    assert list(families) == list(script.FAMILIES)
    assert abs(sum(families.values()) - 0.5 * len(PROFILED)) < 1e-9
    assert families["CODA fused GEMMs"] == 1.5 and families["Liger Triton"] == 1.5
    rows = [{"setting": "bf16", "variant": "x", "step_ms": 30.0, "gpu_busy_ms": 12.0,
             "families": families}]  # fmt: skip
    text = script.family_table(rows)
    assert "| bf16 | x | 30.00 | 12.00 | 1.50 |" in text and "Liger Triton" in text


def test_the_table_without_an_eager_row_has_no_ratio() -> None:
    """``--variants`` without ``hf``: rows carry no speed-up, and the table says so (it raised)."""
    script = load_script("train_step")
    row = {
        "setting": "bf16", "variant": "liger", "correct": True, "loss": 10.8, "grad_norm": 2.9,
        "step_ms": 32.9, "tokens_per_s": 248861.0, "speedup_vs_hf": None, "step_memory_gb": 2.82,
    }  # fmt: skip
    assert "| bf16 | liger | True | 10.8000 | 2.9000 | 32.90 | 248,861 | — | 2.82 |" in (
        script.table([row])
    )


def test_the_table_gives_the_spread_over_runs_and_every_run() -> None:
    script = load_script("train_step")
    row = {
        "setting": "amp", "variant": "coda", "correct": True, "loss": 10.8, "grad_norm": 2.9,
        "step_ms": 32.9, "step_ms_runs": [32.9, 33.1, 32.7], "tokens_per_s": 248861.0,
        "speedup_vs_hf": 1.25, "step_memory_gb": 2.82, "host_ms": 12.5,
    }  # fmt: skip
    assert "| 1.250× | 2.82 | 12.50 | 32.70–33.10 (32.90, 33.10, 32.70) |" in script.table([row])
    both = {**row, "host_ms_back_to_back": 13.25, "host_ms_no_launches": 9.5}
    assert "| 2.82 | 12.50 / 13.25 (9.50 without launches) | 32.70" in script.table([both])
    skipped = {"setting": "amp", "variant": "liger", "skipped": "a | b\nc"}
    assert "| amp | liger | skipped: a / b c |" in script.table([skipped])


def test_the_ratio_to_eager_is_also_taken_within_each_run() -> None:
    """Runs where the host slowed both steps alike (the second) move the medians' ratio, not
    the ratio within each run: the table gives both."""
    script = load_script("train_step")
    runs = [{"hf": 20.0, "coda": 19.0}, {"hf": 30.0, "coda": 31.0}, {"hf": 21.0, "coda": 20.0}]
    ratios = script.paired_ratios(runs, "hf", "coda")
    assert ratios == pytest.approx([20 / 19, 30 / 31, 21 / 20])
    assert script.paired_ratios(runs + [{"coda": 5.0}], "hf", "coda") == ratios  # hf not timed
    row = {
        "setting": "bf16", "variant": "coda", "correct": True, "loss": 10.8, "grad_norm": 2.9,
        "step_ms": 20.0, "step_ms_runs": [19.0, 31.0, 20.0], "tokens_per_s": 1.0,
        "speedup_vs_hf": 21.0 / 20.0, "speedup_vs_hf_runs": ratios, "step_memory_gb": 1.0,
    }  # fmt: skip
    assert "| 1.050× (paired 1.050× (0.968–1.053)) |" in script.table([row])
    one_run = {**row, "speedup_vs_hf_runs": ratios[:1]}
    assert "| 1.050× | 1.00 |" in script.table([one_run])


def test_a_variant_name_is_a_base_variant_and_a_step_mode() -> None:
    split = load_script("train_step").split_variant
    assert split("coda_lm_head_graph") == ("coda_lm_head", "graph")
    assert split("coda_lm_head_ops") == ("coda_lm_head", "ops")
    assert split("coda_lm_head_triton") == ("coda_lm_head", "triton")
    assert split("liger") == ("liger", "")
    assert split("hf_compile") == ("hf_compile", "")


def test_a_triton_variants_step_runs_every_program_on_triton_and_switches_back() -> None:
    from coda.primitives import runtime

    seen: list[str | None] = []

    def step() -> None:
        seen.append(runtime.BACKEND)
        raise ValueError("a step that fails")

    with pytest.raises(ValueError, match="a step that fails"):
        load_script("train_step").on_triton(step)()
    assert seen == ["triton"] and runtime.BACKEND is None


def test_graph_variants_are_not_run_by_default_and_may_share_a_process() -> None:
    script = load_script("train_step")
    parse, variants = script.parse_args, script.family_variants
    llama, qwen3 = (variants(parse([]).variants, f) for f in ("llama", "qwen3"))
    assert not any(v.endswith("_graph") for v in llama + qwen3)
    graphs = [v for v in script.VARIANTS if v.endswith("_graph")]
    assert graphs == ["hf_graph", "coda_graph", "coda_lm_head_graph"]
    assert "coda_lm_head_triton" not in llama  # a comparison of backends, asked for by name
    assert len(llama) == len(script.VARIANTS) - len(graphs) - 1
    assert qwen3 == ["hf", "hf_compile", "coda", "coda_lm_head", "coda_compile", "liger"]
    both = ["--variants", "hf,hf_graph,coda_lm_head_graph", "--settings", "bf16,amp"]
    assert parse(both).variants == "hf,hf_graph,coda_lm_head_graph"
    assert variants(parse(both).variants, "gemma2") == ["hf", "hf_graph", "coda_lm_head_graph"]
    assert parse([*both, "--no-cudnn-attention"]).no_cudnn_attention


def test_an_unknown_variant_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        load_script("train_step").parse_args(["--variants", "hf,coda_lm_heads"])
    err = capsys.readouterr().err
    assert "unknown coda_lm_heads" in err and "coda_lm_head_graph" in err


class FakeCapture:
    """What the bench may use of ``coda.export.capture_train_step``'s step: its warm-up count,
    its calls (the warm-up steps, then the capture on the next call) and the shapes captured."""

    warmup = 3

    def __init__(self, model: object, optimizer: object, batch: dict, loss_fn: object) -> None:
        self.model, self.optimizer, self.example, self.loss_fn = model, optimizer, batch, loss_fn
        self.calls: list[dict] = []

    def __call__(self, batch: dict) -> str:
        self.calls.append(batch)
        return "loss"

    @property
    def captured_shapes(self) -> list[str]:
        return ["input_ids [1, 9], labels [1, 9]"] if len(self.calls) > self.warmup else []


@pytest.mark.parametrize("setting", ["bf16", "amp"])
def test_a_graph_variant_steps_through_the_packages_capture_as_a_user_does(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``_graph`` variants capture through ``capture_train_step`` with the documented
    optimizer (fused, capturable, a tensor lr) and a batch with labels; Hugging Face's loss in
    bf16 is the helper's default, any other one the variant's loss of the batch (under autocast
    in amp); the warm-up and the capture happen before timing, and the timed step holds the
    captured one, which holds the model and optimizer its graph addresses."""
    import gc
    import weakref

    import coda.export

    script = load_script("train_step")
    made: list[FakeCapture] = []

    def capture(*args: object) -> FakeCapture:
        made.append(FakeCapture(*args))
        return made[-1]

    monkeypatch.setattr(coda.export, "capture_train_step", capture)
    bench = script.Bench(dry_run=False)
    bench.device = "cpu"  # the fake captures nothing: a CPU model stands in for the GPU's
    model = torch.nn.Linear(3, 2)
    ids = torch.zeros(1, 9, dtype=torch.long)
    notes: dict = {}
    step = script.train_step(model, script.hf_loss, ids, setting, bench, graph=True, notes=notes)
    captured = made[0]
    assert captured.model is model and len(captured.calls) == FakeCapture.warmup + 1
    group = captured.optimizer.param_groups[0]
    assert group["capturable"] and group["fused"] and isinstance(group["lr"], torch.Tensor)
    assert set(captured.example) == {"input_ids", "labels"} and captured.example["labels"] is ids
    assert notes["graph"] == "captured by capture_train_step: input_ids [1, 9], labels [1, 9]"
    # bf16: the helper's default, model(**batch).loss; amp: Hugging Face's under autocast
    assert (captured.loss_fn is None) == (setting == "bf16")
    held = weakref.ref(captured)
    del captured, made[:]
    gc.collect()
    assert held() is not None and step() == "loss" and len(held().calls) == 5


def test_a_graph_variants_other_losses_read_the_batchs_ids_under_autocast() -> None:
    """A variant whose loss is not Hugging Face's in bf16 gets the capture its own loss of the
    batch's ``input_ids``, under autocast in the amp setting."""
    script = load_script("train_step")
    bench = script.Bench(dry_run=True)
    ids = torch.arange(9).reshape(1, 9)
    seen: list = []

    def loss_fn(model: object, got: torch.Tensor) -> str:
        seen.append((got, torch.is_autocast_enabled("cpu")))
        return "loss"

    assert script.graph_loss(loss_fn, "bf16", bench)(None, {"input_ids": ids}) == "loss"
    assert script.graph_loss(script.hf_loss, "amp", bench)
    assert script.graph_loss(loss_fn, "amp", bench)(None, {"input_ids": ids}) == "loss"
    assert seen == [(ids, False), (ids, True)]


def test_sync_sites_are_named_as_the_capture_refusal_names_them() -> None:
    """``--sync-check`` counts each site of the package's recorded sync warnings once per
    occurrence, named by ``coda.export.train_step.blame`` (file, line, function, source)."""
    import warnings

    from coda.export import train_step as ts

    script = load_script("train_step")
    stacks: list = []

    def reads_a_value() -> None:
        warnings.warn(f"called a {ts.SYNC_WARNING}", UserWarning, stacklevel=1)

    with ts.recording_sync_warnings(stacks):
        reads_a_value()
        reads_a_value()
    ((site, count),) = script.sync_counts(stacks).items()
    assert count == 2 and "test_train_step_script.py:" in site
    assert "in reads_a_value: `warnings.warn(" in site


def test_dry_run_of_other_families_patches_with_patch_model_and_says_what_it_skips(
    tmp_path: Path,
) -> None:
    """Qwen3 and OLMo 2 (toy widths): the coda variants run on ``patch_model`` and match Hugging
    Face's step (OLMo 2's post-norm MLP half included); a variant that means nothing for the
    family is skipped with the reason (neither layer class fuses the MLP half's residual as
    Llama's does; Liger needs a GPU); step times come from every run and each profiled step says
    where the GPU waits."""
    variants = "hf,coda_mlp,coda_lm_head,coda_lm_head_hf_residual,liger"
    argv = ["--dry-run", "--family", "qwen3,olmo2", "--out", str(tmp_path), "--variants", variants]
    argv += ["--settings", "bf16", "--runs", "2", "--gaps", "2"]
    assert load_script("train_step").main(argv) == 0
    qwen3 = json.loads((tmp_path / "qwen3_train_step.json").read_text())
    olmo2 = json.loads((tmp_path / "olmo2_train_step.json").read_text())
    assert qwen3["model"]["model_type"] == "qwen3" and olmo2["model"]["model_type"] == "olmo2"
    assert qwen3["model"]["head_dim"] == 16 and qwen3["model"]["num_hidden_layers"] == 2
    ran = {f: {r["variant"]: r for r in result["rows"]} for f, result in
           (("qwen3", qwen3), ("olmo2", olmo2))}  # fmt: skip
    for family, names in (("qwen3", ("hf", "coda_mlp", "coda_lm_head")),
                          ("olmo2", ("hf", "coda_mlp", "coda_lm_head"))):  # fmt: skip
        for name in names:
            row = ran[family][name]
            assert row["correct"] and len(row["step_ms_runs"]) == 2, (family, name)
            assert min(row["step_ms_runs"]) <= row["step_ms"] <= max(row["step_ms_runs"])
            gaps = row["gaps"]  # a CPU profile: no GPU work, the step is one idle stretch
            assert gaps["gpu_busy_ms"] == 0 and gaps["gap_count"] == 1
            assert gaps["gaps"][0]["ms"] == pytest.approx(gaps["step_ms"])
            assert gaps["gaps"][0]["cpu_op"]  # the op the host was in at the gap's middle
    lm_head = ran["qwen3"]["coda_lm_head"]["patched"]["final norm + LM head loss"]
    assert lm_head.startswith("patched (llama_lm_head_ce")
    assert ran["qwen3"]["coda_mlp"]["patched"]["MLP half"].startswith("patched")
    assert ran["olmo2"]["coda_mlp"]["patched"]["MLP half"].startswith("patched (olmo2_mlp_branch")
    assert (
        "Qwen3DecoderLayer adds the MLP half's residual"
        in (ran["qwen3"]["coda_lm_head_hf_residual"]["skipped"])
    )
    assert all("need a GPU" in ran[f]["liger"]["skipped"] for f in ran)
    side_by_side = (tmp_path / "train_step_families.md").read_text()
    assert "| Qwen3 | bf16 | " in side_by_side and "| OLMo 2 | bf16 | " in side_by_side
    assert "| hf | coda_mlp | coda_lm_head | coda_lm_head_hf_residual | liger |" in side_by_side
    olmo2_line = next(line for line in side_by_side.splitlines() if line.startswith("| OLMo 2"))
    cells = olmo2_line.split(" | ")  # family, setting, hf, coda_mlp, …, liger
    assert cells[2].endswith("(1.000×)") and cells[-1].strip(" |") == "skipped"
    text = (tmp_path / "olmo2_train_step.md").read_text()
    assert text.startswith("# OLMo 2 training steps") and "Where the GPU waits" in text
    assert "skipped: Liger-Kernel's" in text and "patch_model's report" in text


def test_idle_gaps_name_what_the_host_did_while_the_gpu_waited() -> None:
    """A step of three kernels: a launch-bound gap (the host in a Python function running an
    op) and a gap that began while the host was blocked in a sync; the step ends with the last
    kernel, after the step's range closed."""
    script = load_script("train_step")
    span = script.Span
    window = span(0.0, 100.0, script.STEP_RANGE, thread=1)
    gpu = [span(10.0, 30.0, "k1"), span(25.0, 40.0, "k2"), span(70.0, 90.0, "k3"),
           span(95.0, 120.0, "k4")]  # fmt: skip
    cpu = [
        span(0.0, 100.0, "model.py(10): forward", thread=1),
        span(41.0, 68.0, "aten::mm", thread=1),
        span(45.0, 50.0, "<built-in method mm>", thread=1),
        span(50.0, 60.0, "cudaLaunchKernel", thread=1),  # a runtime call is not "the op"
        span(88.0, 91.0, "cudaStreamSynchronize", thread=1),
        span(91.0, 94.0, "autograd.py(5): backward", thread=2),
    ]
    summary = script.idle_gaps(gpu, cpu, window, top=2)
    assert summary["step_ms"] == pytest.approx(0.120)  # until k4 ends
    assert summary["gpu_busy_ms"] == pytest.approx(0.075)  # k1 ∪ k2, k3, k4
    assert summary["gpu_idle_ms"] == pytest.approx(0.045) and summary["gap_count"] == 3
    assert summary["idle_after_sync_ms"] == pytest.approx(0.005)
    first, second = summary["gaps"]
    assert (first["at_ms"], first["ms"]) == (pytest.approx(0.040), pytest.approx(0.030))
    assert first["cpu_op"] == "aten::mm" and first["python"] == "model.py(10): forward"
    assert first["thread"] == "main" and first["after_sync"] is None
    assert first["next_kernel"] == "k3"
    assert (second["at_ms"], second["ms"]) == (pytest.approx(0.0), pytest.approx(0.010))
    assert second["next_kernel"] == "k1"
    assert [(g["at_ms"], g["after_sync"]) for g in summary["every_gap"]] == [
        (pytest.approx(0.0), None), (pytest.approx(0.040), None),
        (pytest.approx(0.090), "cudaStreamSynchronize"),
    ]  # fmt: skip
    top = script.idle_gaps(gpu, cpu, window, top=3)["gaps"]
    assert top[2]["after_sync"] == "cudaStreamSynchronize" and top[2]["thread"] == "other"
    # no op runs at the gap's middle: the host is in Python, after the op that ended last
    bare = [span(41.0, 50.0, "aten::mm", thread=1), span(51.0, 52.0, "cudaLaunchKernel", 1)]
    longest = script.idle_gaps(gpu, bare, window, top=1)["gaps"][0]
    assert (longest["cpu_op"], longest["thread"]) == ("Python after aten::mm", "main")


def test_every_family_builds_its_config_at_its_real_widths() -> None:
    """The configs (not the models: no weights) of every family at the widths the docstring
    gives: the installed transformers accepts each, and the head widths work out."""
    import transformers

    script = load_script("train_step")
    assert script.parse_families("all") == list(script.MODELS)
    assert script.MODELS["mistral"].layers == 2 and script.MODELS["qwen3"].layers == 4
    for family, spec in script.MODELS.items():
        config = getattr(transformers, spec.config)(**spec.widths, num_hidden_layers=2)
        head = getattr(config, "head_dim", None) or config.hidden_size // (
            config.num_attention_heads
        )
        assert head in (64, 96, 128, 256), family
        assert config.num_attention_heads % config.num_key_value_heads == 0, family
    gemma2 = transformers.Gemma2Config(**script.MODELS["gemma2"].widths)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    assert script.MODELS["llama"].widths["vocab_size"] == 32000  # comparable with earlier runs


def test_an_unknown_family_is_refused_with_the_known_ones(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        load_script("train_step").parse_args(["--family", "llama,falcon"])
    err = capsys.readouterr().err
    assert "unknown falcon" in err and "qwen3" in err and "or all" in err


def test_liger_gets_the_familys_function_and_switches_and_its_patch_stays_in_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 3's text model goes to ``apply_liger_kernel_to_gemma3_text`` with GeGLU (not
    SwiGLU) and the fused linear cross-entropy; the module global it replaces is back after the
    call; a family whose function lacks a switch is skipped with the reason."""
    import types

    from transformers.models.gemma3 import modeling_gemma3

    script = load_script("train_step")
    calls: list[dict] = []
    rope = modeling_gemma3.apply_rotary_pos_emb

    def gemma3_text(rope=True, cross_entropy=False, fused_linear_cross_entropy=True,
                    rms_norm=True, geglu=True, model=None):  # fmt: skip
        calls.append({"rope": rope, "cross_entropy": cross_entropy, "rms_norm": rms_norm,
                      "fused_linear_cross_entropy": fused_linear_cross_entropy, "geglu": geglu,
                      "model": model})  # fmt: skip
        modeling_gemma3.apply_rotary_pos_emb = "liger rope"

    def qwen3(rope=True, rms_norm=True, model=None):  # no swiglu switch
        calls.append({"rope": rope})

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_gemma3_text = gemma3_text
    fake.apply_liger_kernel_to_qwen3 = qwen3
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    gpu = script.Bench.__new__(script.Bench)
    gpu.dry_run = False
    model = torch.nn.Linear(2, 2)
    assert script.liger_model(model, "gemma3", gpu) is model
    assert calls == [{"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True,
                      "rms_norm": True, "geglu": True, "model": model}]  # fmt: skip
    assert modeling_gemma3.apply_rotary_pos_emb is rope
    with pytest.raises(script.Skipped, match="apply_liger_kernel_to_qwen3 has no "):
        script.liger_model(model, "qwen3", gpu)
    with pytest.raises(script.Skipped, match="no apply_liger_kernel_to_phi3"):
        script.liger_model(model, "phi3", gpu)


def test_a_coda_variant_is_skipped_when_the_report_keeps_what_it_measures() -> None:
    script = load_script("train_step")
    attn, mlp = "input norm + attention input", "MLP half"
    head = "final norm + LM head loss"
    lines = {attn: "kept: no input_layernorm", mlp: "patched (llama_mlp)", head: "kept: fused_loss"}
    assert script.coda_skip_reason("coda_mlp", lines) is None
    assert script.coda_skip_reason("coda", lines) is None  # the MLP half alone is still coda
    assert script.coda_skip_reason("coda_lm_head", lines) == f"{head} kept: fused_loss"
    assert script.coda_skip_reason("coda_compile", lines) == f"{head} kept: fused_loss"
    lines[mlp] = "kept: a post-norm"
    assert script.coda_skip_reason("coda_mlp", lines) == f"{mlp} kept: a post-norm"
    assert script.coda_skip_reason("coda_fused", lines) == (
        f"{attn} kept: no input_layernorm; {mlp} kept: a post-norm"
    )


def test_a_family_that_fails_to_build_does_not_stop_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = load_script("train_step")

    def family_result(args, family, bench, env):
        if family == "qwen3":
            raise TypeError("Qwen3Config got an unexpected keyword")
        return [{"setting": "bf16", "variant": "hf", "correct": True, "step_ms": 2.0,
                 "speedup_vs_hf": 1.0}]  # fmt: skip

    monkeypatch.setattr(script, "family_result", family_result)
    argv = ["--dry-run", "--family", "qwen3,llama", "--out", str(tmp_path)]
    assert script.main(argv) == 1
    table = (tmp_path / "train_step_families.md").read_text()
    assert "| Qwen3 | — | error |  |" in table and "| Llama | bf16 |  | 2.00 (1.000×) |" in table


def _frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_the_memory_peak_is_what_the_trace_holds_at_once_by_allocation_site() -> None:
    """The replay of an allocator trace: the peak is the largest total live at once (a block
    freed before the next allocation does not count), a free of a block allocated before the
    recording is ignored, and each live block is named by its innermost frames in coda,
    transformers or the bench — not PyTorch's own."""
    script = load_script("train_step")
    torch_frame = _frame("/venv/site-packages/torch/nn/functional.py", 10, "linear")
    coda = [torch_frame, _frame("/repo/export/lm_head_chunks.py", 242, "forward")]
    hf = [_frame("/venv/site-packages/transformers/models/llama/modeling_llama.py", 5, "fwd")]
    events = [
        {"action": "free_requested", "addr": 99, "size": 1000},  # allocated before recording
        {"action": "alloc", "addr": 1, "size": 300, "frames": coda},
        {"action": "alloc", "addr": 2, "size": 200, "frames": hf},
        {"action": "free_requested", "addr": 2, "size": 200},
        {"action": "alloc", "addr": 3, "size": 250, "frames": coda},  # peak: 300 + 250
        {"action": "free_requested", "addr": 1, "size": 300},
        {"action": "alloc", "addr": 4, "size": 100, "frames": []},
    ]
    peak, live = script.live_at_peak(events)
    assert peak == 550
    site = "lm_head_chunks.py:242:forward"
    assert sorted(live) == [(250, site), (300, site)]
    assert script.allocation_site(hf) == "modeling_llama.py:5:fwd"
    assert script.allocation_site([torch_frame]) == "linear"  # nothing of ours: the op
    rows = [{"setting": "bf16", "variant": "coda", "memory_peak": {
        "peak_gb": 5.5e-7, "groups": [{"site": site, "gb": 5.5e-7}]}}]  # fmt: skip
    text = script.memory_tables(rows)
    assert "bf16 coda: memory live at the step's peak" in text
    assert f"| 0.000 | {site} |" in text
    assert script.memory_tables([{"setting": "bf16", "variant": "hf", "memory_peak": None}]) == ""
