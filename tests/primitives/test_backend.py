"""Importing coda changes nothing else in the process: no environment variable is set, Triton may
be imported first (as Hugging Face models import it), and kernels that are not coda's stay as
Triton made them; without a GPU coda's own kernels still run, in the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coda.primitives import backend

SCRIPT = textwrap.dedent(
    """
    import os
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
    {first}
    import torch
    import torch._dynamo  # sets TORCHINDUCTOR_CACHE_DIR itself when first imported

    before = dict(os.environ)
    import coda.primitives
    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    import coda.export
    from coda.export import llama_mlp_function

    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    assert "TRITON_INTERPRET" not in os.environ

    @triton.jit
    def user_kernel(x_ptr):
        tl.store(x_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, 2)), axis=0))

    assert isinstance(user_kernel, JITFunction), type(user_kernel)

    torch.manual_seed(0)
    M, d, f = 5, 16, 24
    x, gamma = torch.randn(M, d), 1 + 0.1 * torch.randn(d)
    w_gate, w_up, w_down = (torch.randn(*s) * s[1] ** -0.5 for s in ((f, d), (f, d), (d, f)))
    out = llama_mlp_function(1e-5, verify=False, tune="off")(x, gamma, w_gate, w_up, w_down)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    want = x + (torch.nn.functional.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    assert isinstance(tl.sum, JITFunction), "triton.language was left interpreted"
    assert isinstance(user_kernel, JITFunction)
    print("ok")
    """
)


def _run(first: str, folder: Path) -> None:
    """Run ``SCRIPT`` in a fresh interpreter (Triton reads a kernel's source from its file)."""
    script = folder / "user_script.py"
    script.write_text(SCRIPT.format(first=first))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen without a GPU")
def test_triton_first_then_coda_runs_its_kernels_and_changes_nothing_else(tmp_path: Path) -> None:
    _run("", tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen without a GPU")
def test_a_hugging_face_model_imported_first_does_not_stop_coda(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _run("from transformers import LlamaForCausalLM", tmp_path)


def test_only_coda_kernels_are_interpreted() -> None:
    import triton
    from triton.runtime.jit import JITFunction

    def body(x_ptr):  # noqa: ANN001, ANN202
        pass

    plain = triton.jit(body)
    ours = backend.interpreted(plain)
    assert isinstance(plain, JITFunction)
    assert isinstance(ours, backend.CodaInterpretedFunction) == backend.INTERPRET
    assert backend.interpreted(ours) is ours
