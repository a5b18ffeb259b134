"""bench/llama_train_step.py: it fails fast without a GPU, and its dry run (CPU, toy model) runs
every code path of the GPU run — patched and compiled variants, both settings, the correctness
check against Hugging Face's own step, tables and result files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench import load_script

pytest.importorskip("transformers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the no-GPU message")
def test_fails_fast_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert load_script("llama_train_step").main(["--out", str(tmp_path)]) == 2
    assert "llama_train_step.py needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_dry_run_checks_every_variant_against_hugging_face(tmp_path: Path) -> None:
    variants = "hf,coda_mlp,coda,coda_fused,coda_lm_head,coda_lm_head_decide,coda_lm_head_ops"
    variants += ",coda_compile,coda_lm_head_graph"  # (a graph is GPU-only: the plain step here)
    argv = ["--dry-run", "--out", str(tmp_path), "--variants", variants, "--sync-check"]
    argv += ["--host", "--cprofile", "coda_lm_head"]
    assert load_script("llama_train_step").main(argv) == 0
    result = json.loads((tmp_path / "llama_train_step.json").read_text())
    rows = result["rows"]
    assert [(r["setting"], r["variant"]) for r in rows] == [
        (s, v) for s in ("bf16", "amp") for v in variants.split(",")
    ]
    assert all(r["correct"] and r["step_ms"] > 0 and r["host_ms"] > 0 for r in rows)
    assert all(r["syncs"] is None for r in rows)  # GPU only: not measured in a dry run
    for setting in ("bf16", "amp"):  # the patched step's host hot spots, by cumulative time
        profile = (tmp_path / f"cprofile-{setting}-coda_lm_head.txt").read_text()
        assert "profiled steps: 1" in profile and "cumulative" in profile
        assert "causal_lm_loss" in profile
    assert not list(tmp_path.glob("cprofile-*-hf.txt"))
    from coda.export import autograd
    from coda.primitives import launch, runtime

    # coda_lm_head_decide and coda_lm_head_ops switched them back
    assert autograd.EAGER_CALLS and launch.DIRECT and runtime.REPLAY
    assert result["model"]["num_hidden_layers"] == 2
    assert "DRY RUN" in (tmp_path / "llama_train_step.md").read_text()


def test_a_variants_module_patches_apply_only_inside_its_own_forward() -> None:
    """Liger's patch also reassigns globals of ``modeling_llama`` (its RoPE), which every other
    variant in the process would then run; contained, the patched model's forward sees them and
    nothing else does, even when its forward raises."""
    import types

    script = load_script("llama_train_step")
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
    script = load_script("llama_train_step")
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
    script = load_script("llama_train_step")
    row = {
        "setting": "bf16", "variant": "liger", "correct": True, "loss": 10.8, "grad_norm": 2.9,
        "step_ms": 32.9, "tokens_per_s": 248861.0, "speedup_vs_hf": None, "step_memory_gb": 2.82,
    }  # fmt: skip
    assert "| bf16 | liger | True | 10.8000 | 2.9000 | 32.90 | 248,861 | — | 2.82 |" in (
        script.table([row])
    )


def test_a_variant_name_is_a_base_variant_and_a_step_mode() -> None:
    split = load_script("llama_train_step").split_variant
    assert split("coda_lm_head_graph") == ("coda_lm_head", "graph")
    assert split("coda_lm_head_ops") == ("coda_lm_head", "ops")
    assert split("liger") == ("liger", "")
    assert split("hf_compile") == ("hf_compile", "")


def test_graph_variants_are_not_run_by_default_and_may_share_a_process() -> None:
    parse = load_script("llama_train_step").parse_args
    assert "_graph" not in parse([]).variants
    both = ["--variants", "hf,hf_graph,coda_lm_head_graph", "--settings", "bf16,amp"]
    assert parse(both).variants == "hf,hf_graph,coda_lm_head_graph"
    assert parse([*both, "--no-cudnn-attention"]).no_cudnn_attention


def test_a_replay_holds_what_its_graph_reads_and_writes() -> None:
    """A captured step's graph addresses the model's, gradients' and optimizer's memory: the
    replay keeps them alive (it did not, and a later capture's empty_cache() freed them)."""
    import gc
    import weakref

    script = load_script("llama_train_step")

    class Graph:
        replays = 0

        def replay(self) -> None:
            Graph.replays += 1

    class Model:
        pass

    def train_step(model: Model) -> tuple[object, weakref.ref]:
        return (lambda: model), weakref.ref(model)  # the step is what holds the model

    step, held = train_step(Model())
    replay = script.Replay(Graph(), "loss", step, optimizer=object())
    del step
    gc.collect()
    assert held() is not None and replay() == "loss" and Graph.replays == 1
