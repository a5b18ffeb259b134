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
    variants = "hf,coda_mlp,coda,coda_fused,coda_lm_head,coda_compile"
    argv = ["--dry-run", "--out", str(tmp_path), "--variants", variants, "--sync-check"]
    assert load_script("llama_train_step").main(argv) == 0
    result = json.loads((tmp_path / "llama_train_step.json").read_text())
    rows = result["rows"]
    assert [(r["setting"], r["variant"]) for r in rows] == [
        (s, v) for s in ("bf16", "amp") for v in variants.split(",")
    ]
    assert all(r["correct"] and r["step_ms"] > 0 for r in rows)
    assert all(r["syncs"] is None for r in rows)  # GPU only: not measured in a dry run
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
