"""coda.primitives — the typed composition API for GEMM-epilogue programs, and its two executors.

* IR: ``Program``, ``GemmEpilogue``, ``Operand``, ``MainloopConfig`` and the registered epilogue
  ops, aux steps and prep steps (``EpilogueOp.registry``, ``AuxStep.registry``,
  ``PrepStep.registry``).
* ``ProgramBuilder``: the fluent Python form of the same IR; ``Program.to_python()`` prints it.
* ``analyze``: validation and shape resolution (raises ``ProgramError`` with a location).
* ``execute_reference``: the PyTorch reference executor.
* ``compile_program``: Triton codegen + runtime (compiled on a GPU, interpreted on a CPU).
* ``load_plugins``: extra primitives from user (or test) modules, parseable like built-in ones.
"""

from .analysis import ProgramInfo, analyze, analyze_all, bind_sizes
from .base import AuxStep, EpilogueOp, Port, PrepStep
from .builder import ProgramBuilder
from .errors import ProgramError
from .ir import GemmEpilogue, MainloopConfig, Operand, Program, TensorDecl
from .plugins import PluginError, load_plugins, plugin_scope
from .reference import execute_reference, outputs_of
from .runtime import CompiledProgram, compile_program

__all__ = [
    "AuxStep",
    "CompiledProgram",
    "EpilogueOp",
    "GemmEpilogue",
    "MainloopConfig",
    "Operand",
    "PluginError",
    "Port",
    "PrepStep",
    "Program",
    "ProgramBuilder",
    "ProgramError",
    "ProgramInfo",
    "TensorDecl",
    "analyze",
    "analyze_all",
    "bind_sizes",
    "compile_program",
    "execute_reference",
    "load_plugins",
    "outputs_of",
    "plugin_scope",
]
