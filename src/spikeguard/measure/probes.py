"""Probes: activation max, attention-logit p99 per head, per-layer gradient norms.

Each probe is armed by a flag and runs every ``*_every`` steps. Forward hooks only record device
tensors (one ``amax`` reduction per hooked module); :meth:`Probes.collect` stacks them and does a
single host read per probe step, after the step's work has been queued. The values land in the
step record under their names: ``activation_max``, ``activation_max_module``,
``attn_logit_p99`` (the largest over layers and heads) with ``attn_logit_p99_layer`` and the
full [layer][head] table ``attn_logit_p99_heads``, and
``layer_grad_norm/<layer>`` for each block (``signals.layer_of``; the norm of the unsharded
gradient under FSDP2, TP or DDP: one all-reduce of a vector at the probe interval, so every rank must collect
at the same steps). Given the optimizer, the probes also carry the early-warning signals of
``measure/signals.py`` (update ratio, spike share, attention-logit bound; ``ProbeConfig.signals``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._validate import check_int
from ._grad_layout import collect
from .signals import SignalConfig, Signals, SignalValues, layer_of

__all__ = ["ProbeConfig", "ProbeValues", "Probes", "guard_probes", "layer_grad_norms"]

_SKIP_TYPES = (nn.Dropout, nn.Identity, nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """Which probes run, and how often."""

    activation_max: bool = True
    """Record max |output| over every leaf module (watch it from step zero: it is the earliest sign of a logit blow-up)."""
    activation_every: int = 10
    """Steps between activation-max readings. A reading reads every activation once more (about
    5% of a CPU step of GPTConfig.bench()), so the default samples the trend every 10 steps."""
    attn_logit_p99: bool = False
    """Record the per-head p99 of |pre-softmax attention logits| (needs model support)."""
    attn_every: int = 100
    """Steps between attention-logit readings."""
    layer_grad_norms: bool = True
    """Record the gradient norm of each layer."""
    grad_norms_every: int = 100
    """Steps between per-layer gradient norms (default 100)."""
    signals: SignalConfig = field(default_factory=SignalConfig)
    """The early-warning signals (update ratio, spike share, logit bound) and their intervals."""

    def __post_init__(self) -> None:
        for name in ("activation_every", "attn_every", "grad_norms_every"):
            check_int(getattr(self, name), f"ProbeConfig.{name}", default=getattr(type(self), name))


def layer_grad_norms(model: nn.Module, *, pp_group: dist.ProcessGroup | None = None,
                     tp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """L2 norm of the gradients of each layer (``signals.layer_of``: the model's blocks, such as
    ``blocks.i`` or an HF causal LM's ``model.layers.i``), as host floats.

    Global, like ``grad_stats``: under FSDP2, HSDP, TP or DDP each layer's norm is that of its
    unsharded gradient, computed from the local pieces weighted by their copy counts (DTensor
    placements; ``pp_group``/``tp_group`` as in ``grad_stats``) and ONE all-reduce of the vector
    of per-layer sums of squares over the default group, then one host read. A collective when
    the world has more than one rank: every rank must call it at the same steps, and every rank
    must hold the same layer names (so not across pipeline stages, whose layers differ).
    Per-tensor norms run in float32 (float64 for float64 gradients) and combine in float64."""
    groups: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, p in model.named_parameters():
        if p.grad is not None:
            groups[layer_of(name)].append(p)
    if not groups:
        return {}
    layouts = [collect(params, pp_group=pp_group, tp_group=tp_group) for params in groups.values()]
    with torch.no_grad():
        device = layouts[0].device()
        sums = torch.stack([layout.sumsq(device) for layout in layouts])
        if layouts[0].world > 1:
            dist.all_reduce(sums)
        values = sums.sqrt().tolist()
    return dict(zip(groups, values))


@dataclass
class ProbeValues:
    """One step's probe readings on their way to the host: ``vector`` (device, or None when no
    probe was due) and the names that ``decode`` attaches to its numbers."""

    vector: torch.Tensor | None
    act_names: list[str]
    heads_shape: tuple[int, int] | None
    grad_norms: dict[str, float]
    signals: SignalValues | None = None

    def decode(self, values: list[float]) -> dict[str, Any]:
        """The record entries from ``vector``'s values read on the host."""
        record: dict[str, Any] = {}
        values = list(values)
        if self.act_names:
            record["activation_max"] = values.pop(0)
            record["activation_max_module"] = self.act_names[int(values.pop(0))]
        if self.heads_shape is not None:
            record["attn_logit_p99"] = values.pop(0)
            record["attn_logit_p99_layer"] = int(values.pop(0))
            n_layers, n_heads = self.heads_shape
            record["attn_logit_p99_heads"] = [values[i * n_heads:(i + 1) * n_heads]
                                              for i in range(n_layers)]
        for layer, norm in self.grad_norms.items():
            record[f"layer_grad_norm/{layer}"] = norm
        if self.signals is not None:
            record.update(self.signals.decode(values[-self.signals.size:]))
        return record


class Probes:
    """Attach to a model; call :meth:`start_step` before the forward and :meth:`collect` after the
    backward (and before ``zero_grad``). With ``optimizer`` the signals that read it (update
    ratio, spike share) hook its step; the logit bound needs only the model."""

    def __init__(self, model: nn.Module, config: ProbeConfig | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Probes(model) takes a torch.nn.Module, got {type(model).__name__}")
        if config is not None and not isinstance(config, ProbeConfig):
            raise TypeError(f"Probes(model, config): config must be a ProbeConfig, got "
                            f"{type(config).__name__}")
        self.model = model
        self.config = config or ProbeConfig()
        self._step = -1
        self._act: list[torch.Tensor] = []
        self._act_names: list[str] = []
        self._handles = []
        if self.config.activation_max:
            for name, module in model.named_modules():
                if name and not list(module.children()) and not isinstance(module, _SKIP_TYPES):
                    self._handles.append(module.register_forward_hook(self._make_hook(name)))
        self._attn_modules = [m for m in model.modules() if hasattr(m, "logit_p99_request")]
        if self.config.attn_logit_p99 and not self._attn_modules:
            raise ValueError("ProbeConfig.attn_logit_p99=True but the model has no attention module "
                             "that can report logits (GPT's Attention has one); turn the probe off")
        self.signals = Signals(model, optimizer, self.config.signals)

    def _make_hook(self, name: str):
        def hook(module, args, output):
            if self._act_on and isinstance(output, torch.Tensor) and output.is_floating_point():
                lo, hi = torch.aminmax(output.detach())  # one pass, no |x| temporary
                self._act.append(torch.maximum(-lo, hi).float())
                self._act_names.append(name)
        return hook

    @property
    def _act_on(self) -> bool:
        return self.config.activation_max and self._step % self.config.activation_every == 0

    def _attn_on(self, step: int) -> bool:
        return self.config.attn_logit_p99 and step % self.config.attn_every == 0

    def start_step(self, step: int) -> None:
        """Arm the probes due at ``step``."""
        self._step = step
        self.signals.start_step(step)
        self._act.clear()
        self._act_names.clear()
        for m in self._attn_modules:
            m.logit_p99_request = self._attn_on(step)
            m.last_logit_p99 = None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Extra forward passes inside (a re-run of the step) leave the current step's readings
        as they were: activations they record are dropped and the attention probes stay off."""
        n_act = len(self._act)
        attn = [(m.logit_p99_request, m.last_logit_p99) for m in self._attn_modules]
        for m in self._attn_modules:
            m.logit_p99_request = False
        self.signals.paused = True
        try:
            yield
        finally:
            self.signals.paused = False
            del self._act[n_act:], self._act_names[n_act:]
            for m, (req, last) in zip(self._attn_modules, attn):
                m.logit_p99_request, m.last_logit_p99 = req, last

    def gather(self) -> ProbeValues:
        """The due probes' values for the current step, still on the device (no host read): a
        flat vector plus what :meth:`ProbeValues.decode` needs to name them. A per-layer
        grad-norm step is the exception: one all-reduce and one host read (every rank must call
        it at the same steps under torch.distributed)."""
        pending: list[torch.Tensor] = []
        act_names: list[str] = []
        if self._act:
            acts = torch.stack(self._act)
            pending += [acts.max().reshape(1), acts.argmax().float().reshape(1)]
            act_names = list(self._act_names)
        p99 = [m.last_logit_p99 for m in self._attn_modules if m.last_logit_p99 is not None]
        heads_shape: tuple[int, int] | None = None
        if p99:
            heads = torch.stack([t.float() for t in p99])  # [layers, heads]
            heads_shape = (heads.shape[0], heads.shape[1])
            pending += [heads.max().reshape(1), heads.max(dim=1).values.argmax().float().reshape(1),
                        heads.flatten()]
        grad_norms: dict[str, float] = {}
        if self.config.layer_grad_norms and self._step % self.config.grad_norms_every == 0:
            grad_norms = layer_grad_norms(self.model)
        signals = self.signals.gather()
        if signals.vector is not None:
            pending.append(signals.vector)
        device = pending[0].device if pending else torch.device("cpu")
        vector = torch.cat([t.to(device) for t in pending]) if pending else None
        return ProbeValues(vector, act_names, heads_shape, grad_norms,
                           signals if signals.vector is not None else None)

    def collect(self) -> dict[str, Any]:
        """The due probes' values for the current step, as host numbers (one host read; at a
        per-layer grad-norm step one all-reduce and one more read, so under torch.distributed
        every rank must call it at the same steps)."""
        values = self.gather()
        return values.decode(values.vector.tolist() if values.vector is not None else [])

    def remove(self) -> None:
        """Detach every hook."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.signals.remove()
        for m in self._attn_modules:
            m.logit_p99_request = False


def guard_probes(model: nn.Module, optimizer: torch.optim.Optimizer, config: ProbeConfig, *,
                 probes: Probes | bool | None, signals: bool,
                 pp_group: dist.ProcessGroup | None = None) -> Probes | None:
    """The guard's probes: ``probes`` True builds every probe of ``config``, a Probes object is
    used as it is, False builds none. None (the default) builds the signals of
    ``config.signals`` only, the other probes off, when ``signals`` is set: the detector's
    update-ratio rule reads them, and they ride in the read-back vector the guard reads anyway.
    Under pipeline parallelism (``pp_group``) none: the stages hold different layers, and the
    signals' all-reduce needs every rank to hold the same ones. Nor for an optimizer that keeps
    no step hooks (a subclass that skipped ``Optimizer.__init__``): torch would never call them."""
    if probes is True:
        return Probes(model, config, optimizer=optimizer)
    hooks = hasattr(optimizer, "_optimizer_step_pre_hooks")
    if probes is None and signals and pp_group is None and hooks:
        quiet = replace(config, activation_max=False, attn_logit_p99=False,
                        layer_grad_norms=False)
        return Probes(model, quiet, optimizer=optimizer)
    return probes or None
