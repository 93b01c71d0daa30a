"""torchtitan's Trainer with the guard on 2 gloo ranks (torchrun), the scenarios named, in order,
in one job (torchtitan's import is most of a short job's time):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests._titan_job OUT \
        outlier outlier_lag1 rollback refusals nan

- ``outlier``: a corrupt batch at step 10 of 16; the job is stopped before torchtitan's step
  15 (a kill between checkpoints), then a second trainer resumes in the same folder to the end;
  two inner optimizers (torchtitan's param groups: Adam for the norms, AdamW for the rest).
- ``outlier_lag1``: the same with ``read_lag=1`` (a GPU's default: ``guard.step()`` skips
  through fused AdamW's found_inf, and each checkpoint is written during the next step, with
  the dataloader and counters as the step left them).
  Saves, per rank, the params, AdamW moments and step counts, the LR and the scheduler position
  around steps 10, 11 and 12, and the steps each rank recorded and skipped.
- ``rollback``: a clean run of 20 steps (through examples/torchtitan_train.py), then the same run with corrupt batches at steps 10-15
  (six skips in a row: Tier 2) and ``tier2="rollback"``, replayed at the scheduled LR
  (``rollback_lr_scale=1``: this run's LR decays to 0 by step 20, and a half-LR replay of 12 of
  its 20 steps would leave it behind for that reason alone) and without the weights check (a
  re-run per skip, not what this scenario is about); saves both runs' final loss on fixed
  held-out sequences.
- ``refusals``: the messages of the configurations GuardedTrainer and guarded() refuse.
- ``nan``: two micro-batches per step (gradient accumulation); step 2's sums of cross-entropy
  and log Z per micro-batch and rank, computed apart from the trainer in float64; a NaN in one
  gradient (rank 0's shard of ``layers.1.feed_forward.w2.weight``) at step 6: the guard halts,
  ``report.json`` names the tensor, the job exits non-zero.

Every scenario holds the grad rule at the flat 3x median (``grad_z`` near 0), as the HF and
Lightning tests do: these test the framework's skip, rollback and halt, not the bar. The tests
(tests/test_integrations_torchtitan.py) read what it leaves in OUT.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import spikeguard as sg
import tests._titan_cpu as titan_cpu  # the CPU patches, before torchtitan is imported
from spikeguard.data import load_corpus
from spikeguard.integrations.exits import exit_status
from spikeguard.integrations.torchtitan import GuardedTrainer

NAN_PARAM = "layers.1.feed_forward.w2.weight"
QUIET = 2
"""arm_quiet of the outlier, rollback and recurring scenarios: the grad rule turns on 2 quiet
updates after arm_after (5), before their first fault (guard step 8 or 10). They test the skip,
the resume and the rollbacks, not arming; faults 20 steps later would move every checkpoint and
roughly double this job (arm_quiet also arms the log Z rules and calms the skip storm)."""


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(trainer: GuardedTrainer) -> dict[str, Any]:
    """Full params, Adam(W) moments and step counts (gathered: every rank calls this), every
    inner optimizer group's LR and the LR schedulers' positions."""
    named = list(trainer.model_parts[0].named_parameters())
    inner = trainer.optimizers.optimizers
    moments = {}
    for name, p in named:
        st = next((o.state[p] for o in inner if p in o.state), {})
        moments[name] = {k: _full(v) for k, v in st.items() if torch.is_tensor(v)}
    return {"params": {n: _full(p) for n, p in named}, "moments": moments,
            "lr": [g["lr"] for o in inner for g in o.param_groups],
            "optimizers": [type(o).__name__ for o in inner],
            "sched": [s.last_epoch for s in trainer.lr_schedulers.schedulers]}


class StepsSink:
    """Every record's step and whether it was skipped, on this rank."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, bool]] = []

    def log(self, record: dict[str, Any], step: int) -> None:
        self.steps.append((int(record["step"]), bool(record.get("skipped"))))


class Probe(GuardedTrainer):
    """GuardedTrainer with test hooks: snapshots around the steps in ``watch``, a stop before
    ``stop_at``, a NaN in one gradient at ``nan_at`` (torchtitan's step numbers, 1-based: the
    guard's step + 1)."""

    watch: tuple[int, ...] = ()
    reference_at: int | None = None
    stop_at: int | None = None
    nan_at: int | None = None
    scale_at: tuple[int, ...] = ()
    folders: dict[str, int] | None = None

    def __init__(self, config: Any) -> None:
        self.steps_seen = StepsSink()
        super().__init__(config, sinks=[self.steps_seen])
        self.snaps: dict[str, Any] = {}
        self.first_step: int | None = None
        self.out = Path(config.dump_folder)

    def reference(self, input_dict: dict, labels: torch.Tensor) -> list[float]:
        """This micro-batch's sums of cross-entropy and log Z and its token count, in float64
        from torch's own functions (before the step's update: an independent reference)."""
        seen = self.ntokens_seen
        inputs, labels, extra = self.post_dataloading_process(dict(input_dict), labels)
        self.ntokens_seen = seen
        with torch.no_grad():
            logits = self.model_parts[0](inputs, **extra).double().flatten(0, 1)
            labels = labels.flatten()
            return [float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum")),
                    float(torch.logsumexp(logits, dim=-1).sum()), float(labels.numel())]

    def train_step(self, data_iterator: Any) -> None:
        if self.first_step is None:
            self.first_step = self.step
        if self.step == self.stop_at:
            raise KeyboardInterrupt(f"stopped before step {self.step}")
        if self.folders is not None:
            self.folders.update(checkpoint_folders(self.out))
        step = self.step
        if step in self.watch:
            self.snaps[step] = {"before": snapshot(self)}
        super().train_step(data_iterator)
        if step in self.watch:
            self.snaps[step]["after"] = snapshot(self)

    def forward_backward_step(self, **kw: Any) -> torch.Tensor:
        if self.step == self.reference_at:  # every micro-batch of the step, on this rank
            sums = self.snaps.setdefault("reference", [])
            sums.append(self.reference(kw["input_dict"], kw["labels"]))
            (self.out / f"reference-rank{dist.get_rank()}.json").write_text(json.dumps(sums))
        loss = super().forward_backward_step(**kw)
        if self.step in self.scale_at:  # the gradients x1000: a fault that is not the data
            for p in self.model_parts[0].parameters():
                if p.grad is not None:
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(1000.0)
        if self.step == self.nan_at and dist.get_rank() == 0:
            p = dict(self.model_parts[0].named_parameters())[NAN_PARAM]
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            local.view(-1)[0] = float("nan")
        return loss


def checkpoint_folders(out: Path) -> dict[str, int]:
    """Every checkpoint folder under ``out`` (listed ones and those set aside), by path, with
    the inode of its DCP ``.metadata`` (a rename keeps it)."""
    return {str(p.parent.relative_to(out)): p.stat().st_ino
            for p in out.rglob(".metadata")}


def build(out: Path, steps: int, guard: sg.GuardConfig, **kw: Any) -> Probe:
    cfg = titan_cpu.debug_config(str(out), steps=steps, guard=guard, **kw)
    return Probe(cfg)


def held_out_loss(trainer: GuardedTrainer, n: int = 16) -> float:
    """Mean cross-entropy of the trained model on ``n`` fixed held-out sequences per rank."""
    val = load_corpus("pydoc").val
    seq = trainer.config.training.seq_len
    rank = dist.get_rank()
    rows = [torch.from_numpy(val[(rank * n + i) * (seq + 1):(rank * n + i + 1) * (seq + 1)]
                             .astype("int64")) for i in range(n)]
    x = torch.stack(rows).to(trainer.device)
    model = trainer.model_parts[0]
    with torch.no_grad():
        positions = torch.arange(seq, device=x.device).expand(n, seq)
        masks = model.get_attention_masks(positions=positions)
        logits = model(x[:, :-1], attention_masks=masks)
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                               x[:, 1:].flatten()).double()
    dist.all_reduce(ce)
    return float(ce) / dist.get_world_size()


def outlier(out: Path, read_lag: int = 0) -> None:
    guard = sg.GuardConfig(detector=sg.DetectorConfig.for_run(16, arm_after=5, grad_z=0.01,
                                                              arm_quiet=QUIET),
                           read_lag=read_lag)
    first = build(out, 16, guard, poison=(10,), two_optimizers=True)
    first.watch, first.stop_at = (11, 12, 13), 15
    try:
        first.train()
    except KeyboardInterrupt:
        pass
    first.close()
    if dist.get_rank() == 0:
        shutil.copy(out / "metrics.jsonl", out / "metrics-first.jsonl")
    dist.barrier()
    second = build(out, 16, guard, poison=(10,), two_optimizers=True)
    second.train()
    state = {"snaps": first.snaps, "first": first.steps_seen.steps,
             "second": second.steps_seen.steps, "resumed_at": second.first_step}
    second.close()
    torch.save(state, out / f"outlier-rank{dist.get_rank()}.pt")


def rollback(out: Path) -> None:
    steps = 20
    detector = sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01, arm_quiet=QUIET)
    # the clean run through examples/torchtitan_train.py (torchtitan's train.py shape)
    from examples import torchtitan_train

    cfg = titan_cpu.debug_config(str(out / "clean"), steps=steps,
                                 guard=sg.GuardConfig(detector=detector))
    clean = torchtitan_train.main(cfg, guard=cfg.guard)
    clean_loss = held_out_loss(clean)
    guard = sg.GuardConfig(detector=detector, tier2="rollback", rollback_lr_scale=1.0,
                           weights_check=False)
    rolled = build(out / "rollback", steps, guard, poison=tuple(range(10, 16)))
    rolled.folders = {}  # every checkpoint folder seen before each step
    rolled.train()
    result = {"clean": clean_loss, "rollback": held_out_loss(rolled),
              "rollbacks": rolled.guard.rollbacks, "seen": rolled.folders,
              "after": checkpoint_folders(out / "rollback")}
    rolled.close()
    if dist.get_rank() == 0:
        (out / "rollback.json").write_text(json.dumps(result))


def recurring(out: Path, lr_scale: float = 1.0, max_rollbacks: int = 3) -> None:
    """The gradients x1000 at torchtitan's steps 9-16 (guard 8-15), whatever the batch: the
    first storm rolls back, the replay meets it again. At a replay LR of 1x the run halts
    saying so; below 1x (``recurring_keep``) it rolls back again at a lower LR kept for good,
    until the budget is spent."""
    steps = 16
    guard = sg.GuardConfig(detector=sg.DetectorConfig.for_run(steps, arm_after=5, grad_z=0.01,
                                                              arm_quiet=QUIET),
                           tier2="rollback", rollback_lr_scale=lr_scale, weights_check=False,
                           max_rollbacks=max_rollbacks)
    trainer = build(out, steps, guard)
    trainer.scale_at = tuple(range(9, 17))
    try:
        trainer.train()
    except sg.TrainingHalted as halt:
        if dist.get_rank() == 0:
            (out / "recurring.json").write_text(json.dumps(
                {"rollbacks": trainer.guard.rollbacks, "halt": str(halt)}))
    finally:
        trainer.close()


def example(out: Path) -> None:
    """examples/torchtitan_train.py as docs/torchtitan.md runs it on a laptop (its arguments;
    the job is the torchrun), with the CPU helper the example imports off a GPU."""
    from examples import torchtitan_train

    argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--checkpoint.enable",
            "--training.steps", "4", "--training.seq_len", "32", "--training.local_batch_size",
            "2", "--dump_folder", str(out / "run")]
    torchtitan_train.main(argv=argv).close()


def refusals(out: Path) -> None:
    """What GuardedTrainer and guarded() refuse, before torchtitan builds anything."""
    from torchtitan.components.loss import MSELoss

    from spikeguard.integrations.torchtitan import guarded

    guard = sg.GuardConfig()
    cases = {
        "clip": lambda c: setattr(c.training, "max_norm", 0.5),
        "rollback": lambda c: (setattr(c, "guard", sg.GuardConfig(tier2="rollback")),
                               setattr(c.checkpoint, "enable", False)),
        "loss": lambda c: setattr(c, "loss", MSELoss.Config()),
    }
    messages = {}
    for name, change in cases.items():
        cfg = titan_cpu.debug_config(str(out / name), steps=2, guard=guard)
        change(cfg)
        try:
            GuardedTrainer(cfg)
        except ValueError as e:
            messages[name] = str(e)
    cfg = titan_cpu.debug_config(str(out / "mse"), steps=2, guard=guard)
    cfg.loss = MSELoss.Config()
    try:
        guarded(cfg)
    except ValueError as e:
        messages["guarded"] = str(e)
    if dist.get_rank() == 0:
        (out / "refusals.json").write_text(json.dumps(messages))


def nan(out: Path) -> None:
    guard = sg.GuardConfig(detector=sg.DetectorConfig.for_run(8, arm_after=5, grad_z=0.01))
    trainer = build(out, 8, guard, accumulate=2)
    trainer.nan_at, trainer.reference_at = 7, 3
    try:
        trainer.train()
    finally:
        trainer.close()


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    # on a GPU (benchmarks/gpu_check.py) NCCL for the tensors, gloo for what stays on the CPU
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        for name in sys.argv[2:]:
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            {"outlier": outlier, "outlier_lag1": lambda f: outlier(f, read_lag=1),
             "rollback": rollback, "recurring": recurring,
             "recurring_keep": lambda f: recurring(f, lr_scale=0.5, max_rollbacks=2),
             "example": example,
             "refusals": refusals, "nan": nan}[name](folder)
            if dist.get_rank() == 0:
                (folder / "done").write_text(", ".join(titan_cpu.PATCHES))
            dist.barrier()
    except sg.TrainingHalted as halt:  # the halt's exit status, as the example's
        print(f"rank {dist.get_rank()}: TrainingHalted: {halt}", flush=True)
        dist.barrier()  # every rank halted at the same step: each says so before any exits
        sys.exit(exit_status(halt))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
