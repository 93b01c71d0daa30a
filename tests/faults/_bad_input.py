"""The bad-input table: for every name in ``spikeguard.__all__`` (and the building blocks this
file imports from their modules), calls that are wrong, the error each must raise, the words its
message must hold, and the state that must not change.

Kinds of bad input: a wrong type, dtype or device; parameters without gradients; an empty
parameter list or batch; a negative, non-finite or absurd config value; a checkpoint of another
model shape. ``NOT_CALLED`` lists the public names that take no user input (an exception the library
raises, a record it returns) with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import spikeguard as sg
from spikeguard.checkpoint import CheckpointError, CheckpointWarning, verify_checkpoint
from spikeguard.data import load_corpus
from spikeguard.measure.fp8 import AmaxMonitor
from spikeguard.measure.probes import Probes
from spikeguard.prevent.attention import QKNorm, attention, softcap
from spikeguard.prevent.budget import memory_budget
from spikeguard.prevent.init import fan_in_init_, gpt2_residual_init_
from spikeguard.prevent.losses import router_z_loss
from spikeguard.prevent.mup import mup_param_groups
from spikeguard.record import metrics_record
from spikeguard.sinks import ConsoleSink, Sinks, TensorBoardSink, WandbSink, read_metrics
from tests.faults._bad_objects import (
    _LOGITS,
    _Q,
    _TARGET,
    _TOKENS,
    _ckpt_state,
    _fresh_detector,
    _guard_state,
    _model,
    _other_shape,
    _saved,
    _saved_by_guard,
    _stream,
    _trained,
    _with_grads,
    _write,
)

__all__ = ["CASES", "NOT_CALLED", "Case"]

NOT_CALLED = {
    "TrainingHalted": "an exception the guard raises with its report",
    "Verdict": "a record SpikeDetector.update returns",
}


@dataclass
class Case:
    name: str
    """The public name under test."""
    what: str
    """The bad input, in words."""
    call: Callable[[dict], Any]
    """Makes the bad call with the objects ``setup`` built."""
    match: tuple[str, ...]
    """Words the message must hold (the field or argument, the value or the problem)."""
    raises: tuple[type[BaseException], ...] = (ValueError, TypeError)
    setup: Callable[[], dict] = dict
    """Builds the objects the call uses (fresh for each case)."""
    state: Callable[[dict], Any] | None = None
    """What must be the same before and after the call (compared with ``snapshot``)."""
    warns: type[Warning] | None = None
    """A warning the call may issue on its way to the error (checked to be of this type)."""
    extra: dict = field(default_factory=dict)


def _cases(tmp_factory: Callable[[], Any]) -> list[Case]:
    ck = lambda: _saved(tmp_factory())  # noqa: E731
    m = _model
    return [
        # -- prevent --------------------------------------------------------------------------
        Case("cross_entropy", "float targets", lambda c: sg.cross_entropy(_LOGITS, _TARGET.float()),
             ("target dtype", "float32", "integer")),
        Case("cross_entropy", "integer logits", lambda c: sg.cross_entropy(_LOGITS.long(), _TARGET),
             ("logits", "floating-point", "int64")),
        Case("cross_entropy", "target on another device",
             lambda c: sg.cross_entropy(_LOGITS, _TARGET.to("meta")), ("meta", "cpu", "one device")),
        Case("cross_entropy", "a target id past the vocabulary",
             lambda c: sg.cross_entropy(_LOGITS, torch.full_like(_TARGET, 300)),
             ("300", "outside", "256")),
        Case("cross_entropy", "negative z_loss", lambda c: sg.cross_entropy(_LOGITS, _TARGET, z_loss=-1.0),
             ("z_loss=-1", "negative")),
        Case("linear_cross_entropy", "hidden and weight of other widths",
             lambda c: sg.linear_cross_entropy(torch.randn(8, 64), torch.randn(256, 32),
                                               torch.randint(0, 256, (8,))), ("hidden", "H=32")),
        Case("linear_cross_entropy", "chunk_size 0",
             lambda c: sg.linear_cross_entropy(torch.randn(8, 64), torch.randn(256, 64),
                                               torch.randint(0, 256, (8,)), chunk_size=0),
             ("chunk_size=0",)),
        Case("linear_cross_entropy", "weight on another device",
             lambda c: sg.linear_cross_entropy(torch.randn(8, 64), torch.randn(256, 64, device="meta"),
                                               torch.randint(0, 256, (8,))), ("meta", "one device")),
        Case("router_z_loss", "integer logits",
             lambda c: router_z_loss(torch.ones(4, 3, dtype=torch.long)), ("router_logits", "floating")),
        Case("router_z_loss", "mask of another shape",
             lambda c: router_z_loss(torch.ones(4, 3), mask=torch.ones(5, dtype=torch.bool)),
             ("mask shape", "(5,)")),
        Case("softcap", "cap 0", lambda c: softcap(torch.ones(3), 0), ("cap=0", "positive")),
        Case("softcap", "cap -inf", lambda c: softcap(torch.ones(3), -math.inf), ("cap=-inf",)),
        Case("attention", "q, k of other head dims",
             lambda c: attention(_Q, torch.randn(1, 2, 4, 6), _Q), ("shapes do not match",)),
        Case("attention", "integer q, k, v", lambda c: attention(_Q.long(), _Q.long(), _Q.long()),
             ("floating-point", "int64")),
        Case("attention", "k on another device", lambda c: attention(_Q, _Q.to("meta"), _Q),
             ("one device", "meta")),
        Case("attention", "softcap -1", lambda c: attention(_Q, _Q, _Q, softcap=-1.0),
             ("softcap=-1.0",)),
        Case("attention", "3-D inputs", lambda c: attention(_Q[0], _Q[0], _Q[0]), ("4-D",)),
        Case("QKNorm", "head_dim 0", lambda c: QKNorm(0), ("head_dim=0",)),
        Case("QKNorm", "negative eps", lambda c: QKNorm(8, eps=-1.0), ("eps=-1",)),
        Case("QKNorm", "q of another head dim",
             lambda c: c["n"](torch.ones(2, 4), torch.ones(2, 4)), ("head_dim=8", "(2, 4)"),
             setup=lambda: dict(n=QKNorm(8)), state=lambda c: c["n"].state_dict()),
        Case("fan_in_init_", "a 1-D weight", lambda c: fan_in_init_(c["w"]), (">= 2 dims", "(4,)"),
             setup=lambda: dict(w=torch.ones(4)), state=lambda c: c["w"]),
        Case("fan_in_init_", "an integer weight", lambda c: fan_in_init_(c["w"]),
             ("floating-point", "int64"), setup=lambda: dict(w=torch.ones(4, 4, dtype=torch.long)),
             state=lambda c: c["w"]),
        Case("fan_in_init_", "negative gain", lambda c: fan_in_init_(c["w"], gain=-1.0),
             ("gain=-1",), setup=lambda: dict(w=torch.ones(4, 4)), state=lambda c: c["w"]),
        Case("gpt2_residual_init_", "an empty weight list", lambda c: gpt2_residual_init_([], 2),
             ("weights=[]",)),
        Case("gpt2_residual_init_", "n_layer 0", lambda c: gpt2_residual_init_([c["w"]], 0),
             ("n_layer=0",), setup=lambda: dict(w=torch.ones(4, 4)), state=lambda c: c["w"]),
        Case("gpt2_residual_init_", "negative std",
             lambda c: gpt2_residual_init_([c["w"]], 2, std=-0.02), ("std=-0.02",),
             setup=lambda: dict(w=torch.ones(4, 4)), state=lambda c: c["w"]),
        Case("memory_budget", "negative parameter count", lambda c: memory_budget(-1),
             ("n_params=-1",)),
        Case("memory_budget", "NaN parameter count", lambda c: memory_budget(math.nan),
             ("n_params=nan",)),
        Case("memory_budget", "0 GPUs", lambda c: memory_budget(1e9, n_gpus=0), ("n_gpus=0",)),
        Case("memory_budget", "ZeRO stage 4", lambda c: memory_budget(1e9, zero_stage=4),
             ("zero_stage=4",)),
        Case("schedules", "negative warmup",
             lambda c: sg.schedules.warmup_cosine(warmup_steps=-1, total_steps=10),
             ("warmup_steps=-1",)),
        Case("schedules", "warmup as long as the run",
             lambda c: sg.schedules.warmup_cosine(warmup_steps=10, total_steps=10),
             ("warmup_steps=10", "total_steps=10")),
        Case("schedules", "min_ratio 2", lambda c: sg.schedules.warmup_cosine(
            warmup_steps=1, total_steps=10, min_ratio=2), ("min_ratio=2",)),
        Case("schedules", "wsd decay_fraction 1.5", lambda c: sg.schedules.wsd(
            warmup_steps=1, total_steps=10, decay_fraction=1.5), ("decay_fraction=1.5",)),
        # -- data -----------------------------------------------------------------------------
        Case("load_corpus", "an unknown corpus", lambda c: load_corpus("nope"), ("'nope'",)),
        Case("load_corpus", "val_fraction 1.5", lambda c: load_corpus(val_fraction=1.5),
             ("val_fraction=1.5",)),
        Case("TokenStream", "a list of tokens",
             lambda c: sg.TokenStream([1, 2, 3], batch_size=2, seq_len=8), ("tokens", "list")),
        Case("TokenStream", "float tokens",
             lambda c: sg.TokenStream(_TOKENS.astype(np.float32), batch_size=2, seq_len=8),
             ("integer token ids", "float32")),
        Case("TokenStream", "an empty token array",
             lambda c: sg.TokenStream(_TOKENS[:0], batch_size=2, seq_len=8), ("0 tokens",)),
        Case("TokenStream", "batch_size 0",
             lambda c: sg.TokenStream(_TOKENS, batch_size=0, seq_len=8), ("batch_size=0",)),
        Case("TokenStream", "rank outside the world",
             lambda c: sg.TokenStream(_TOKENS, batch_size=2, seq_len=8, rank=3, world_size=2),
             ("rank=3", "world_size=2")),
        Case("TokenStream", "the state of a stream with another batch size",
             lambda c: c["s"].load_state_dict(sg.TokenStream.from_corpus(
                 "pydoc", batch_size=4, seq_len=16).state_dict()), ("batch_size=4",),
             setup=_stream, state=lambda c: c["s"].state_dict()),
        Case("TokenStream", "a skip range backwards", lambda c: c["s"].skip(5, 2), ("[5, 2]",),
             setup=_stream, state=lambda c: c["s"].state_dict()),
        # -- model ----------------------------------------------------------------------------
        Case("GPTConfig", "n_layer 0", lambda c: sg.GPTConfig(n_layer=0), ("n_layer=0",)),
        Case("GPTConfig", "heads not dividing the width", lambda c: sg.GPTConfig(n_head=3),
             ("n_head=3", "d_model=128")),
        Case("GPTConfig", "dropout 1.5", lambda c: sg.GPTConfig(dropout=1.5), ("dropout=1.5",)),
        Case("GPTConfig", "negative z_loss", lambda c: sg.GPTConfig(z_loss=-1e-4), ("z_loss=-0.0001",)),
        Case("GPT", "a string for the config", lambda c: sg.GPT("tiny"), ("GPTConfig", "str")),
        Case("GPT", "float token ids", lambda c: c["m"](torch.ones(2, 8)), ("token ids", "float32"),
             setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        Case("GPT", "an empty batch", lambda c: c["m"](torch.zeros(0, 8, dtype=torch.long)),
             ("empty batch", "(0, 8)"), setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        Case("GPT", "tokens on another device",
             lambda c: c["m"](torch.zeros(2, 8, dtype=torch.long, device="meta")), ("meta", "cpu"),
             setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        Case("GPT", "a token id past the vocabulary",
             lambda c: c["m"](torch.full((2, 8), 300)), ("300", "vocabulary", "256"),
             setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        Case("GPT", "a sequence longer than seq_len",
             lambda c: c["m"](torch.zeros(1, 65, dtype=torch.long)), ("65", "seq_len=64"),
             setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        # -- detect ---------------------------------------------------------------------------
        Case("grad_stats", "a string for the parameters", lambda c: sg.grad_stats("weights"),
             ("parameters", "str")),
        Case("grad_stats", "2-D extras", lambda c: sg.grad_stats(c["model"].parameters(),
                                                                extras=torch.ones(2, 2)),
             ("extras=(2, 2)", "1-D"), setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("clip_grad_norm_", "max_norm -1", lambda c: sg.clip_grad_norm_(
            c["model"].parameters(), -1.0), ("max_norm=-1",), setup=lambda: _with_grads(_trained()),
             state=_guard_state),
        Case("clip_grad_norm_", "norm_type 'two'", lambda c: sg.clip_grad_norm_(
            c["model"].parameters(), 1.0, norm_type="two"), ("norm_type='two'",),
             setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("clip_grad_norm_", "a list holding a non-tensor",
             lambda c: sg.clip_grad_norm_([c["w"], 3.0], 1.0), ("parameters[1]", "float"),
             setup=lambda: dict(w=torch.ones(3, requires_grad=True))),
        Case("grad_stats", "GradStats.clip_ with max_norm 0",
             lambda c: sg.grad_stats(c["model"].parameters()).clip_(0.0), ("max_norm=0",),
             setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("PrecisionPolicy", "fp8 as a kind", lambda c: sg.PrecisionPolicy(kind="fp8"),
             ("kind='fp8'",)),
        Case("PrecisionPolicy", "init_scale 0", lambda c: sg.PrecisionPolicy(init_scale=0),
             ("init_scale=0",)),
        Case("PrecisionPolicy", "growth_interval 0", lambda c: sg.PrecisionPolicy(growth_interval=0),
             ("growth_interval=0",)),
        Case("AmaxMonitor", "history_len 0", lambda c: AmaxMonitor(history_len=0),
             ("history_len=0",)),
        Case("AmaxMonitor", "negative margin", lambda c: AmaxMonitor(margin=-1), ("margin=-1",)),
        Case("AmaxMonitor", "an unknown fp8 format", lambda c: AmaxMonitor(fmt="e3m4"),
             ("fmt='e3m4'",)),
        Case("ProbeConfig", "activation_every 0", lambda c: sg.ProbeConfig(activation_every=0),
             ("activation_every=0",)),
        Case("Probes", "a string for the model", lambda c: Probes("model"), ("nn.Module", "str")),
        Case("Probes", "a dict for the config", lambda c: Probes(c["m"], {}),
             ("ProbeConfig", "dict"), setup=lambda: dict(m=m()), state=lambda c: c["m"].state_dict()),
        # -- respond --------------------------------------------------------------------------
        Case("DetectorConfig", "grad_k -1", lambda c: sg.DetectorConfig(grad_k=-1), ("grad_k=-1",)),
        Case("DetectorConfig", "grad_k NaN", lambda c: sg.DetectorConfig(grad_k=math.nan),
             ("grad_k=nan",)),
        Case("DetectorConfig", "median_window 0", lambda c: sg.DetectorConfig(median_window=0),
             ("median_window=0",)),
        Case("DetectorConfig", "alert above skip", lambda c: sg.DetectorConfig(alert_ratio=3.0),
             ("alert_ratio", "skip_ratio")),
        Case("DetectorConfig", "for_run of 2 steps", lambda c: sg.DetectorConfig.for_run(2),
             ("total_steps=2",)),
        Case("SpikeDetector", "a string for the config", lambda c: sg.SpikeDetector("strict"),
             ("DetectorConfig", "str")),
        Case("SpikeDetector", "a dict for the step", lambda c: c["d"].update({"step": 3}),
             ("StepMetrics", "dict"), setup=_fresh_detector, state=lambda c: c["d"].state_dict()),
        Case("SpikeDetector", "a string loss",
             lambda c: c["d"].update(sg.StepMetrics(step=3, loss="2.0", grad_norm=1.0)),
             ("StepMetrics.loss='2.0'", "number"), setup=_fresh_detector,
             state=lambda c: c["d"].state_dict()),
        Case("SpikeDetector", "a tensor loss",
             lambda c: c["d"].update(sg.StepMetrics(step=3, loss=torch.tensor(2.0), grad_norm=1.0)),
             ("StepMetrics.loss", "torch.Tensor"), setup=_fresh_detector,
             state=lambda c: c["d"].state_dict()),
        Case("SpikeDetector", "state of an unknown version", lambda c: c["d"].load_state_dict({}),
             ("version",), setup=_fresh_detector, state=lambda c: c["d"].state_dict()),
        Case("StepMetrics", "a string step, through the detector",
             lambda c: c["d"].update(sg.StepMetrics(step="3", loss=2.0, grad_norm=1.0)),
             ("StepMetrics.step='3'",), setup=_fresh_detector, state=lambda c: c["d"].state_dict()),
        Case("Action", "an unknown action", lambda c: sg.Action("explode"), ("'explode'",)),
        Case("metrics_record", "a dict for the metrics", lambda c: metrics_record({"step": 1}),
             ("StepMetrics", "dict")),
        Case("metrics_record", "tier 7", lambda c: metrics_record(
            sg.StepMetrics(step=0, loss=1.0, grad_norm=1.0), tier=7), ("tier=7",)),
        Case("metrics_record", "an unknown action", lambda c: metrics_record(
            sg.StepMetrics(step=0, loss=1.0, grad_norm=1.0), action="explode"), ("action='explode'",)),
        Case("CheckpointManager", "every 0", lambda c: sg.CheckpointManager(tmp_factory(), every=0),
             ("every=0",)),
        Case("CheckpointManager", "on_error 'ignore'",
             lambda c: sg.CheckpointManager(tmp_factory(), on_error="ignore"),
             ("on_error='ignore'", "'raise'", "'warn'")),
        Case("CheckpointManager", "keep -1", lambda c: sg.CheckpointManager(tmp_factory(), keep=-1),
             ("keep=-1",)),
        Case("CheckpointManager", "a checkpoint of a narrower model (d_model 32)",
             lambda c: sg.CheckpointManager(c["mgr"].directory, model=c["model"],
                                            optimizer=c["opt"]).restore(),
             ("[64, 64]", "[32, 32]", "blocks.0"), raises=(CheckpointError,),
             setup=lambda: _other_shape(ck(), d_model=32), state=_ckpt_state,
             warns=CheckpointWarning),
        Case("CheckpointManager", "a checkpoint of a shallower model (n_layer 3)",
             lambda c: sg.CheckpointManager(c["mgr"].directory, model=c["model"],
                                            optimizer=c["opt"]).restore(),
             ("Missing key", "blocks.2"), raises=(CheckpointError,),
             setup=lambda: _other_shape(ck(), n_layer=3), state=_ckpt_state,
             warns=CheckpointWarning),
        Case("verify_checkpoint", "a directory that is no checkpoint",
             lambda c: verify_checkpoint(tmp_factory()),
             ("not a committed checkpoint", "MANIFEST.json is missing")),
        # -- the guard ------------------------------------------------------------------------
        Case("GuardConfig", "clip 0", lambda c: sg.GuardConfig(clip=0), ("clip=0",)),
        Case("LowerLrConfig", "lr_multiple 2", lambda c: sg.LowerLrConfig(lr_multiple=2.0),
             ("LowerLrConfig.lr_multiple=2.0", "<= 1")),
        Case("LowerLrConfig", "negative steps", lambda c: sg.LowerLrConfig(steps=-1),
             ("LowerLrConfig.steps=-1",)),
        Case("ClipConfig", "an unknown clip_mode", lambda c: sg.ClipConfig(clip_mode="max"),
             ("clip_mode='max'", "zscore")),
        Case("ClipConfig", "update_bound 0.5", lambda c: sg.ClipConfig(update_bound=0.5),
             ("update_bound=0.5", "above 1")),
        Case("SignalConfig", "a negative interval",
             lambda c: sg.SignalConfig(logit_bound_every=-1), ("logit_bound_every=-1",)),
        Case("SignalConfig", "qk_clip 0", lambda c: sg.SignalConfig(qk_clip=0),
             ("qk_clip=0", "None")),
        Case("AttributionConfig", "rerun_budget 0", lambda c: sg.AttributionConfig(rerun_budget=0),
             ("AttributionConfig.rerun_budget=0",)),
        Case("AttributionConfig", "rerun_allowance -1",
             lambda c: sg.AttributionConfig(rerun_allowance=-1),
             ("AttributionConfig.rerun_allowance=-1", "integer >= 0")),
        Case("AttributionConfig", "rerun 'yes'", lambda c: sg.AttributionConfig(rerun="yes"),
             ("AttributionConfig.rerun='yes'", "True or False")),
        Case("mup_param_groups", "a model built without init='mup'", lambda c: mup_param_groups(
            c["m"], lr=1e-3, weight_decay=0.1), ("init='mup'", "init='standard'"),
             setup=lambda: dict(m=m())),
        Case("GuardConfig", "tier2 'panic'", lambda c: sg.GuardConfig(tier2="panic"),
             ("tier2='panic'",)),
        Case("GuardConfig", "read_lag 2", lambda c: sg.GuardConfig(read_lag=2), ("read_lag=2",)),
        Case("GuardConfig", "max_rollbacks -1", lambda c: sg.GuardConfig(max_rollbacks=-1),
             ("max_rollbacks=-1",)),
        Case("GuardConfig", "a dict for the detector", lambda c: sg.GuardConfig(detector={}),
             ("GuardConfig.detector", "DetectorConfig", "dict")),
        Case("Guard", "a string for the optimizer", lambda c: sg.Guard(c["m"], "adamw"),
             ("optimizer", "str"), setup=lambda: dict(m=m())),
        Case("Guard", "a model without parameters", lambda c: sg.Guard(
            torch.nn.Identity(), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)),
             ("no parameters",)),
        Case("Guard", "the optimizer of another model",
             lambda c: sg.Guard(c["m"], torch.optim.AdamW(m().parameters())),
             ("not the model's", "model.parameters()"), setup=lambda: dict(m=m())),
        Case("Guard", "tier2 rollback without checkpoints", lambda c: sg.Guard(
            c["m"], torch.optim.AdamW(c["m"].parameters()),
            config=sg.GuardConfig(tier2="rollback")), ("checkpoints",), setup=lambda: dict(m=m())),
        Case("Guard", "step() before backward (no gradients)",
             lambda c: c["guard"].step(c["model"].loss(c["model"](c["x"]), c["y"])),
             ("no parameter", "gradient", "backward"), setup=_trained, state=_guard_state),
        Case("Guard", "step() with a per-token loss", lambda c: c["guard"].step(torch.ones(4)),
             ("0-d tensor", "(4,)"), setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("Guard", "step() with a loss on another device",
             lambda c: c["guard"].step(torch.tensor(2.0, device="meta")), ("meta", "cpu"),
             setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("Guard", "step() with no loss", lambda c: c["guard"].step(),
             ("needs the step's loss",), setup=lambda: _with_grads(_trained()), state=_guard_state),
        Case("Guard", "resume from a checkpoint of another model shape", lambda c: sg.Guard(
            c["model"], c["opt"], checkpoints=sg.CheckpointManager(c["mgr"].directory)).resume(),
             ("[64, 64]", "[32, 32]"),
             raises=(CheckpointError,),
             setup=lambda: _other_shape(_saved_by_guard(tmp_factory()), d_model=32),
             state=_ckpt_state, warns=CheckpointWarning),
        Case("Guard", "data= a plain iterator (no position, no skip)", lambda c: sg.Guard(
            c["m"], torch.optim.AdamW(c["m"].parameters()), data=iter([])),
             ("data=", "position", "skip"), setup=lambda: dict(m=m())),
        Case("Guard", "decide() on a guard that steps a scheduler", lambda c: sg.Guard(
            c["m"], c["o"], scheduler=torch.optim.lr_scheduler.LambdaLR(c["o"], lambda s: 1.0))
             .decide(torch.tensor(1.0)), ("decide()", "scheduler=None"),
             setup=lambda: dict(m=(mm := m()), o=torch.optim.AdamW(mm.parameters()))),
        Case("Guard", "decide() on a guard that saves its own checkpoints", lambda c: sg.Guard(
            c["m"], c["o"], checkpoints=sg.CheckpointManager(c["d"])).decide(torch.tensor(1.0)),
             ("decide()", "before the framework applies", "guard.stateful()"),
             setup=lambda: dict(m=(mm := m()), o=torch.optim.AdamW(mm.parameters()),
                                d=tmp_factory())),
        Case("GuardedOptimizer", "a guard of another optimizer",
             lambda c: sg.GuardedOptimizer(torch.optim.AdamW(c["model"].parameters()), c["guard"]),
             ("guard", "optimizer"), setup=_trained, state=_guard_state),
        # -- sinks ----------------------------------------------------------------------------
        Case("JsonlSink", "mode 'x'", lambda c: sg.JsonlSink(tmp_factory() / "m.jsonl", mode="x"),
             ("mode='x'",)),
        Case("JsonlSink", "None for the path", lambda c: sg.JsonlSink(None), ("path=None",)),
        Case("JsonlSink", "every rank writing to one file",
             lambda c: sg.JsonlSink(tmp_factory() / "m.jsonl", rank=None), ("{rank}",)),
        Case("ConsoleSink", "every 0", lambda c: ConsoleSink(every=0), ("every=0",)),
        Case("ConsoleSink", "rank -1", lambda c: ConsoleSink(rank=-1), ("rank=-1",)),
        Case("TensorBoardSink", "None for the directory", lambda c: TensorBoardSink(None),
             ("log_dir=None",)),
        Case("TensorBoardSink", "rank 5 of a 1-rank job",
             lambda c: TensorBoardSink(tmp_factory(), rank=5), ("rank=5", "1 rank")),
        Case("WandbSink", "rank -1", lambda c: WandbSink(rank=-1), ("rank=-1",)),
        Case("Sinks", "an object without log()", lambda c: Sinks([object()]),
             ("no log(record, step)",)),
        Case("read_metrics", "a file that is not JSON lines",
             lambda c: read_metrics(c["p"]), ("line 1" if False else ":1:", "not a JSON record"),
             setup=lambda: dict(p=_write(tmp_factory() / "m.jsonl", b"step,loss\n0,2.5\n"))),
        Case("read_metrics", "a missing file", lambda c: read_metrics(tmp_factory() / "none.jsonl"),
             ("No such file", "none.jsonl"), raises=(OSError,)),
    ]


CASES = _cases
