"""bench/experiments/cute_step_configs.py: it loads without the CuTe DSL, reads its configs as the
product's ``CuteConfig``s, and says which way a step's B operand lies in memory as QuACK takes
it (the label its table rows carry)."""

from __future__ import annotations

import json

import pytest
import torch

from coda.primitives.cute.launch import CuteConfig, CuteStep
from coda.primitives.ir import GemmEpilogue, Program

from . import load_script

experiment = load_script("experiments/cute_step_configs")


@pytest.mark.parametrize(
    ("text", "config"),
    [
        ("128x192", CuteConfig(128, 192, 2, 1, True)),
        ("256x128c", CuteConfig(256, 128, 2, 1, False)),
        ("128x128/1x2", CuteConfig(128, 128, 1, 2, True)),
        ("128x128/1x2+e4", CuteConfig(128, 128, 1, 2, True, 4)),
        ("128x128+dyn", CuteConfig(128, 128, 2, 1, True, 0, True)),
        ("256x128c/1x2+e4+dyn", CuteConfig(256, 128, 1, 2, False, 4, True)),
        ("128x128+l4", CuteConfig(128, 128, epi_loads=4)),
        ("128x128/1x2+w64", CuteConfig(128, 128, 1, 2, epi_n=64)),
        ("128x128+e1+l2+w64", CuteConfig(128, 128, epi_stages=1, epi_loads=2, epi_n=64)),
        ("128x128/1x2+ov1", CuteConfig(128, 128, 1, 2, epi_overlap=1)),
        ("128x128+ov0+dyn", CuteConfig(128, 128, dynamic=True, epi_overlap=0)),
        ("128x128+ov2", CuteConfig(128, 128)),
    ],
)
def test_configs_read_as_the_product_s(text: str, config: CuteConfig) -> None:
    assert experiment.parse_config(text) == config
    assert experiment.parse_config(experiment.config_label(config)) == config


def test_an_unknown_modifier_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown modifier.*\+dyn"):
        experiment.parse_config("128x128+dynamic")
    with pytest.raises(ValueError, match=r"unknown modifier.*'ov3'"):
        experiment.parse_config("128x128+ov3")


def test_b_is_labelled_by_its_contiguous_dimension_as_quack_takes_it() -> None:
    # down_bwd reads w_down [d, f] untransposed: QuACK's [N, K] = [f, d] view is N-major as
    # stored, K-major once the weight is copied the other way
    path = experiment.ROOT / "export" / "programs" / "llama_mlp_bwd_saved.json"
    program = Program.model_validate(json.loads(path.read_text())["program"])
    names = program.step_names()
    (step,) = [s for s, n in zip(program.steps, names, strict=True) if n == "down_bwd"]
    runner = CuteStep(step)
    d, f, m = 16, 24, 8
    tensors = {"dout": torch.zeros(m, d), "w_down": torch.zeros(d, f)}
    assert experiment._major(runner, tensors) == "N-major"
    tensors["w_down"] = tensors["w_down"].t().contiguous().t()
    assert experiment._major(runner, tensors) == "K-major"


def test_programs_are_the_shipped_ones_or_else_a_block_the_planner_lowers() -> None:
    shipped, block = experiment._program("llama_mlp_bwd_saved")
    assert block.name == shipped.block == "llama_mlp_bwd_saved"
    lowered, block = experiment._program("gemm_partial_swiglu_bwd")
    assert block.name == lowered.block == "gemm_partial_swiglu_bwd"
    assert any(isinstance(s, GemmEpilogue) for s in lowered.steps)
    with pytest.raises(KeyError):
        experiment._program("no_such_block")
