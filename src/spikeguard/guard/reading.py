"""One step's numbers, named: what the device produces and the host reads, in one record.

``Updater.device_step`` returns a ``StepReading`` of 0-d device tensors; the guard stacks its
fields, in order, into the one float64 vector the host reads one step late (``Readback``: one
copy, no sync), followed by the probes' readings. ``StepReading.read`` turns that vector back
into a ``StepReading`` of host numbers and the probes' tail. No stage indexes the vector by
position: each reads the field it needs by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..readback import Readback

__all__ = ["Pending", "StepReading"]

_INF = float("inf")


class StepReading(NamedTuple):
    """The step's numbers (device tensors before the read; host values after ``read``)."""

    loss: Any
    """The step's mean loss over micro-batches and data ranks (float)."""
    log_z: Any
    """Its mean log Z (NaN when the loss gave none)."""
    grad_norm: Any
    """The global gradient norm before clipping."""
    withheld: Any
    """Whether the device withheld the update (the gate as applied: a skip, never under
    ``respond=False``, only a non-finite step while the weights are known at fault)."""
    armed: Any
    """Whether the gate's statistics were armed at this step."""
    clip_coef: Any
    """The clipping coefficient applied to the gradients (1: not clipped)."""
    grad_scale: Any
    """The fp16 loss scale (NaN without a scaler)."""
    flagged: Any
    """Whether the gate flagged the step (the Tier 1 test or a non-finite value)."""
    update_coef: Any
    """The update bound's coefficient (1: off or not bounded)."""
    lr_jumped: Any
    """Whether the LR jumped on any rank (withheld before it was applied: ``lr_jump.py``)."""
    tokens_flagged: Any = False
    """Whether the input tokens of some rank's batch were past their bar (``tokens.py``)."""
    tokens_score: Any = float("nan")
    """This rank's batch's token surprise in nats (NaN: no tokens given, or none kept yet)."""

    @classmethod
    def read(cls, values: list[float]) -> tuple[StepReading, list[float]]:
        """The host reading from the read-back vector's floats, and the probes' numbers after it."""
        (loss, log_z, norm, withheld, armed, coef, scale, flagged, bounded, jumped, tokens,
         score) = values[:_N]
        return (cls(loss, log_z, norm, withheld != 0.0, armed != 0.0, coef, scale,
                    flagged != 0.0, bounded, jumped != 0.0, tokens != 0.0, score), values[_N:])

    @property
    def finite(self) -> bool:
        """Loss and grad norm are finite (host side)."""
        loss, norm = self.loss, self.grad_norm
        return loss == loss and norm == norm and abs(loss) != _INF and abs(norm) != _INF


_N = len(StepReading._fields)


@dataclass
class Pending:
    """One step on its way to the host: what the host side needs once its numbers are read."""

    step: int
    readback: Readback
    """The step's ``StepReading`` fields as one vector, then the probes' readings."""
    lr: float | None
    batches: tuple[int, int] | None
    """The stream indices of the batches the step consumed (the ledger's span)."""
    data_state: dict[str, Any] | None
    """read_lag 1: the data stream's state after this step (a checkpoint of it is written late)."""
    rerun: Callable[..., Any] | None
    probes: Any
    """The step's ProbeValues (their numbers ride at the end of the read-back vector), or None."""
    stats: Any
    """The step's GradStats while its gradients are alive (read_lag 0), else None."""
    finite: tuple[Any, list[int]] | None = None
    """read_lag 1: per local gradient, whether its norm was finite (a device bool vector, read
    only on the halt path) and its parameter's index: names the culprits after the grads are gone."""
    rows: tuple[Any, ...] = ()
    """Each micro-batch's per-sequence values (LossOutput.sequences, or None)."""
    reference: bool = True
    """Whether ``rerun`` replays this step's own batch later too (the weights check may use it)."""
    framework: bool = False
    """``guard.decide()``: the framework applies the update; the guard applies nothing."""
    lr_factor: float = 1.0
    """The LR multiplier of this step (``Updater.lr``); a release applies it too."""
    lr_jump: str | None = None
    """Why the step was withheld before it was applied: its LR jumped (``lr_jump.py``)."""
    tokens: str | None = None
    """Why the step was withheld for its input tokens (``tokens.py``); set once read."""
    lr_onset: int | None = None
    """A jump after an anomaly at a risen LR (the weights were moved): the first step at it."""
    after_skip: bool = False
    """The gate judged the step with the storm test (``DeviceGate.after_skip``); the host
    detector does too."""

    @property
    def held_before(self) -> bool:
        """Withheld before it was applied, for its LR or its input ids: never released, and the
        gate's own Tier 1 test need not agree."""
        return self.lr_jump is not None or self.tokens is not None

    @property
    def grads_alive(self) -> bool:
        return self.stats is not None
