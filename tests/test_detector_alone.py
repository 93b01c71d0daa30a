"""The detector used on its own must not do harm (the loop README shows for building blocks).

The loop: update the detector with each step's metrics, skip the optimizer step (and the LR
schedule) when ``verdict.skip``, stop on HALT, nothing else: no checkpoints, so a Tier 2's
advice to roll back is nothing it can act on. Through an LR x50 transient for 20 steps (tiny
model, AdamW at lr 3e-3, the real corpus), the detector used to say skip on every step after
the fault and the run never trained again (1.6-1.9x the loss of the same loop without it, 120 steps, seeds 0-1). Now a skip
storm makes the weights the suspect and the detector stops recommending skips: the run ends
within 2% of the same loop without the detector (the skips withhold a few 50x updates and
shift the schedule by as many steps), on three seeds.
"""

from __future__ import annotations

import pytest
import torch

import spikeguard as sg

# the fault meets a detector with every rule on, as a mid-run fault does: the grad rule turns on
# arm_quiet (20) quiet updates after the warmup (20), at step 39 at the earliest. At step 40 (the
# fault's step before the quiet arming, when the grad rule stayed off until step 60) it lands on
# that switch; at 60, with 80 steps after it as before, it does not
STEPS, FAULT, LENGTH, WARMUP = 140, 60, 20, 20


def _run(seed: int, detect: bool) -> tuple[float, int]:
    """Mean training loss of the last 10 steps, and how many steps the loop skipped."""
    torch.manual_seed(seed)
    cfg = sg.GPTConfig.tiny(z_loss=1e-4)
    model = sg.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    schedule = sg.schedules.warmup_cosine(warmup_steps=WARMUP, total_steps=STEPS, min_ratio=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    data = sg.TokenStream.from_corpus("pydoc", batch_size=8, seq_len=cfg.seq_len, seed=seed)
    detector = sg.SpikeDetector(sg.DetectorConfig.for_run(STEPS, warmup_steps=WARMUP))
    losses, skips = [], 0
    for step in range(STEPS):
        x, y = next(data)
        out = model.loss(model(x), y)
        out.loss.backward()
        norm = sg.clip_grad_norm_(model.parameters(), 1.0)
        skip = False
        if detect:
            verdict = detector.update(sg.StepMetrics(step=step, loss=float(out.ce),
                                                     grad_norm=float(norm),
                                                     log_z=float(out.log_z)))
            if verdict.action is sg.Action.HALT:
                break
            skip = verdict.skip
        if not skip:
            scale = 50.0 if FAULT <= step < FAULT + LENGTH else 1.0  # the LR fault
            for group in optimizer.param_groups:
                group["lr"] *= scale
            optimizer.step()
            for group in optimizer.param_groups:
                group["lr"] /= scale
            scheduler.step()
        skips += skip
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(out.ce))
    return sum(losses[-10:]) / 10, skips


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loop_acting_only_on_skip_and_halt_ends_no_worse_than_without_the_detector(seed):
    plain, _ = _run(seed, detect=False)
    guarded, skips = _run(seed, detect=True)
    assert guarded <= 1.02 * plain, (guarded, plain, skips)
    # the storm stops the skipping: a storm's worth and a few isolated ones of the 80 steps
    # after the fault, not all of them (78 before)
    assert skips <= 20
