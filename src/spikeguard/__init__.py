"""spikeguard: keep large-model training runs from diverging.

``import spikeguard as sg`` gives what a training loop calls: the names imported under
``TYPE_CHECKING`` below, the one list of the public API (docs/design.md says why each is there).
Every other building block stays importable from its module, e.g.
``from spikeguard.prevent.attention import QKNorm`` or
``from spikeguard.sinks import read_metrics``.

Type checkers and IDEs read those imports as they stand. At run time each name is imported from
the module named there on first use (PEP 562), so that ``import spikeguard`` stays light: a
command that needs no torch (``spikeguard diagnose`` on a CSV) does not pay for importing it.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # grouped by role, in the order a loop meets them
    # isort: off
    # the model and its data
    from .model import GPT as GPT
    from .model import GPTConfig as GPTConfig
    from .data import TokenStream as TokenStream
    # prevent: the losses, the LR schedules, the clipping rule, the precision policy
    from .prevent.losses import cross_entropy as cross_entropy
    from .prevent.losses import linear_cross_entropy as linear_cross_entropy
    from . import schedules as schedules
    from .prevent.clipping import ClipConfig as ClipConfig
    from .measure.precision import PrecisionPolicy as PrecisionPolicy
    # detect: the gradient norm and clip without a guard, the probes and the early signals
    from .measure.gradnorm import clip_grad_norm_ as clip_grad_norm_
    from .measure.gradnorm import grad_stats as grad_stats
    from .measure.probes import ProbeConfig as ProbeConfig
    from .measure.signals import SignalConfig as SignalConfig
    # respond: the Guard with every config it takes, and the detector on its own
    from .guard import Guard as Guard
    from .guard import GuardConfig as GuardConfig
    from .guard import AttributionConfig as AttributionConfig
    from .guard import LowerLrConfig as LowerLrConfig
    from .guard import GuardedOptimizer as GuardedOptimizer
    from .guard import TrainingHalted as TrainingHalted
    from .detector.config import DetectorConfig as DetectorConfig
    from .detector.detector import SpikeDetector as SpikeDetector
    from .detector.detector import Verdict as Verdict
    from .record import StepMetrics as StepMetrics
    from .record import Action as Action
    # the checkpoints and the metrics log
    from .checkpoint import CheckpointManager as CheckpointManager
    from .sinks import JsonlSink as JsonlSink
    # isort: on

_exports: dict[str, tuple[str, str | None]] | None = None


def _table() -> dict[str, tuple[str, str | None]]:
    """Public name -> (the module that defines it, the attribute there; None: the module itself),
    read once from the imports above."""
    global _exports
    if _exports is None:
        import ast
        from pathlib import Path

        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
        block = next(n for n in tree.body if isinstance(n, ast.If)
                     and getattr(n.test, "id", None) == "TYPE_CHECKING")
        _exports = {a.asname or a.name: (f".{n.module}", a.name) if n.module
                    else (f".{a.name}", None)  # from . import schedules: the module
                    for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    return _exports


def __getattr__(name: str) -> Any:
    if name == "__all__":
        value: Any = sorted(_table())
    elif name in _table():
        import importlib

        module, attribute = _table()[name]
        value = importlib.import_module(module, __name__)
        if attribute is not None:
            value = getattr(value, attribute)
    else:
        raise AttributeError(f"module 'spikeguard' has no attribute {name!r}; building blocks "
                             "are importable from their modules (docs/design.md maps them)")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_table()})
