"""The allowlist generated modules pass before import: every kernel the planner generates for the
built-in blocks passes; hand-written hostile modules are refused, naming what they hold, and
``load_kernel`` (the one import path) runs none of them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from coda.blocks import get_block
from coda.planner import lower
from coda.primitives.analysis import analyze
from coda.primitives.codegen import cache
from coda.primitives.codegen.audit import GeneratedCodeError, check_generated_module
from coda.primitives.codegen.cache import load_kernel
from coda.primitives.codegen.kernel import KernelSource, _in_docstring
from coda.primitives.runtime import compile_program
from coda.primitives.settings import override

GOLDEN = (Path(__file__).parent.parent / "golden" / "llama_mlp.down.py").read_text()
HEAD = '"""doc"""\nimport triton\nimport triton.language as tl\n\n\n'
CANARY = "/tmp/coda-audit-canary"


def _kernel(body: str, params: str = "x_ptr, N") -> str:
    """A module of codegen's shape whose one kernel has ``body`` (indented by the caller)."""
    return f"{HEAD}@triton.jit\ndef k({params}):\n{body}\n"


def _builtin_block_names() -> list[str]:
    """The blocks a fresh process registers (tests in this one may have registered more)."""
    code = "from coda.blocks import list_blocks; print(' '.join(b.name for b in list_blocks()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_every_planner_kernel_of_every_builtin_block_passes() -> None:
    count = 0
    for name in _builtin_block_names():
        block = get_block(name)
        program = lower(block)
        info = analyze(program, block.shapes.cpu[0])
        for kernel in compile_program(program, info, use_vendor=False).kernels.values():
            check_generated_module(kernel.source, name=f"{block.name}.{kernel.step}")
            count += 1
    assert count >= 40  # every block lowers to at least one fused gemm


HOSTILE = {
    "statement after a closed docstring": (
        GOLDEN.replace('"""\nimport triton\n', f'"""\nopen("{CANARY}", "w")\nimport triton\n', 1),
        "line 9: a top-level Expr statement",
    ),
    "os import": (HEAD + "import os\n", "import of os"),
    "from-import": (HEAD + "from os import system\n", "top-level ImportFrom"),
    "missing triton.language": ('"""doc"""\nimport triton\n', "not exactly the imports"),
    "top-level assignment": (HEAD + "x = 1\n", "top-level Assign"),
    "class": (HEAD + "class C:\n    pass\n", "top-level ClassDef"),
    "undecorated function": (HEAD + "def f():\n    pass\n", "decorated with none"),
    "other decorator": (HEAD + "@staticmethod\ndef f():\n    pass\n", "decorated with"),
    "defaults smuggle a call": (
        HEAD + "@triton.jit\ndef f(a=print('x')):\n    pass\n",
        "keywords or defaults",
    ),
    "annotation runs": (
        HEAD + "@triton.jit\ndef f(a: print('x')):\n    pass\n",
        "annotated other than tl.constexpr",
    ),
    "builtin call": (_kernel("    open('/tmp/x', 'w')"), "a call to 'open'"),
    "eval": (_kernel("    y = eval('1')"), "a call to 'eval'"),
    "dunder attribute": (_kernel("    y = x_ptr.__class__"), "the attribute '__class__'"),
    "dunder name": (_kernel("    y = __builtins__"), "the name '__builtins__'"),
    "global name": (_kernel("    y = os"), "the name 'os'"),
    "method outside the list": (_kernel("    y = x_ptr.write(1)"), "the method .write"),
    "deep tl attribute": (_kernel("    y = tl.core.os"), "the attribute .os"),
    "triton runtime": (_kernel("    y = triton.runtime"), "triton.runtime"),
    "inline assembly": (
        _kernel(
            "    y = tl.inline_asm_elementwise('', '', [], dtype=tl.int32, is_pure=True, pack=1)"
        ),
        "tl.inline_asm_elementwise",
    ),
    "string constant": (_kernel("    y = 'rm -rf'"), "the constant 'rm -rf'"),
    "f-string": (_kernel("    y = f'{N}'"), "a JoinedStr expression"),
    "lambda": (_kernel("    y = lambda: 0"), "a Lambda expression"),
    "comprehension": (_kernel("    y = [i for i in range(N)]"), "a ListComp expression"),
    "walrus": (_kernel("    y = (z := 1)"), "a NamedExpr expression"),
    "nested import": (_kernel("    import os"), "a Import statement"),
    "global statement": (_kernel("    global tl"), "a Global statement"),
    "with": (_kernel("    with x_ptr:\n        pass"), "a With statement"),
    "try": (_kernel("    try:\n        pass\n    except Exception:\n        pass"), "a Try"),
    "while": (_kernel("    while N:\n        pass"), "a While statement"),
    "nested def": (_kernel("    def g():\n        pass"), "a FunctionDef statement"),
    "shadowed function": (_kernel("    k = x_ptr\n    k(1)"), "assignment to 'k'"),
    "shadowed tl": (_kernel("    tl = x_ptr"), "assignment to 'tl'"),
    "attribute assignment": (_kernel("    x_ptr.y = 1"), "assignment to a Attribute"),
    "subscript assignment": (_kernel("    x_ptr[0] = 1"), "assignment to a Subscript"),
    "star args": (_kernel("    tl.store(*N)"), "a call with *arguments"),
    "keyword splat": (_kernel("    tl.store(**N)"), "a call with **keywords"),
    "float of a word": (_kernel("    y = float('1e3')"), "float('1e3')"),
    "call of a call": (_kernel("    y = tl.load(x_ptr)(1)"), "a call to a Call"),
    "bytes": (_kernel("    y = b'x'"), "the constant b'x'"),
    "does not parse": (HEAD + "def (:\n", "does not parse"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_modules_are_refused(case: str) -> None:
    source, fragment = HOSTILE[case]
    with pytest.raises(GeneratedCodeError, match="codegen never writes|does not parse") as e:
        check_generated_module(source, name="m.py")
    assert fragment in str(e.value)


def test_load_kernel_runs_nothing_it_refuses(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    with override(cache_dir=tmp_path):
        canary = tmp_path / "canary"
        hostile = GOLDEN.replace(
            '"""\nimport triton\n', f'"""\nopen({str(canary)!r}, "w")\nimport triton\n', 1
        )
        kernel = KernelSource("down", hostile, {})
        with pytest.raises(GeneratedCodeError, match="top-level Expr statement"):
            load_kernel(kernel, "down_kernel_ptr")
        assert not canary.exists()
        assert not list((tmp_path / "kernels").glob("*.py"))  # not even written to the cache


def test_load_kernel_executes_the_checked_text_not_a_changed_file(
    tmp_path: Path,
    monkeypatch,  # noqa: ANN001
) -> None:
    monkeypatch.setattr(cache, "_LOADED", {})  # as in a fresh process
    canary = tmp_path / "canary"
    kernel = KernelSource("down", GOLDEN, {})
    path = tmp_path / "kernels" / f"down_{kernel.digest}.py"
    path.parent.mkdir(parents=True)
    path.write_text(f"open({str(canary)!r}, 'w')\n")  # planted under the name the module will use
    with override(cache_dir=tmp_path):
        assert load_kernel(kernel, "down_kernel_ptr") is not None
    assert not canary.exists()
    assert path.read_text() == GOLDEN


@pytest.mark.parametrize("text", ['s=\'"""; import os\'', "s='\\\\'", "s='\"\"'\"'", "plain"])
def test_docstring_lines_stay_text(text: str) -> None:
    """A plugin's free-text field, printed by repr into the module docstring, cannot end it."""
    module = ast.parse(f'"""{_in_docstring(text)}"""\n')
    (statement,) = module.body
    assert statement.value.value == text
