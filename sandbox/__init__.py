"""coda.sandbox — validate → semantics → compile → verify → profile a candidate; return a Report."""

from .compare import OutputCheck, assert_close, check_output
from .report import ProfileRow, Report, SemanticsCoverage, StageResult
from .runner import evaluate
from .stages import SandboxOptions

__all__ = [
    "OutputCheck",
    "ProfileRow",
    "Report",
    "SandboxOptions",
    "SemanticsCoverage",
    "StageResult",
    "assert_close",
    "check_output",
    "evaluate",
]
