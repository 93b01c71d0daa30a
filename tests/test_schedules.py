import math
import pickle

import pytest
import torch

import spikeguard as sg

S = sg.schedules


def _lambda_lr(schedule, lr=1.0):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def _lrs(schedule, steps):
    opt, sched = _lambda_lr(schedule)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_with_warmup_keeps_its_behaviour():
    f = S.constant_with_warmup(warmup_steps=4)
    assert [f(s) for s in range(7)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    assert S.constant_with_warmup(warmup_steps=0)(0) == 1.0


def test_warmup_cosine_per_step_table():
    f = S.warmup_cosine(warmup_steps=4, total_steps=12, min_ratio=0.1)
    table = {
        0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0,     # warmup ends at the peak
        4: 1.0,                               # p = 0
        6: 0.1 + 0.45 * (1 + math.sqrt(0.5)),  # p = 1/4: cos(pi/4)
        8: 0.55,                              # midpoint W + (T - W) / 2: (1 + min_ratio) / 2
        10: 0.1 + 0.45 * (1 - math.sqrt(0.5)),
        12: 0.1, 13: 0.1, 1000: 0.1,          # the floor is held after T
    }
    for step, want in table.items():
        assert f(step) == pytest.approx(want, abs=1e-12), step
    values = [f(s) for s in range(4, 13)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert S.warmup_cosine(warmup_steps=0, total_steps=10)(5) == pytest.approx(0.5)


@pytest.mark.parametrize(("decay", "mid", "quarter"), [
    ("linear", 0.5, 0.75),
    ("cosine", 0.5, 0.5 * (1 + math.sqrt(0.5))),
    ("1-sqrt", 1 - math.sqrt(0.5), 0.5),
])
def test_wsd_per_step_table(decay, mid, quarter):
    # W = 2, T = 22: 20 post-warmup steps, decay_fraction 0.4 -> 8 decay steps from step 14
    f = S.wsd(warmup_steps=2, total_steps=22, decay_fraction=0.4, decay=decay, min_ratio=0.1)
    assert f.decay_start == 14
    assert [f(s) for s in range(2)] == [0.5, 1.0]
    assert all(f(s) == 1.0 for s in range(2, 15))  # stable
    assert f(16) == pytest.approx(0.1 + 0.9 * quarter, abs=1e-12)  # p = 1/4
    assert f(18) == pytest.approx(0.1 + 0.9 * mid, abs=1e-12)  # p = 1/2
    assert f(22) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)  # decay ends at min_ratio
    values = [f(s) for s in range(14, 23)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_wsd_default_floor_is_zero_and_full_decay_fraction():
    f = S.wsd(warmup_steps=0, total_steps=10, decay_fraction=1.0)
    assert f.min_ratio == 0.0 and f.decay_start == 0
    assert [f(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: S.warmup_cosine(warmup_steps=10, total_steps=10), "warmup_steps=10 >= total_steps=10"),
    (lambda: S.warmup_cosine(warmup_steps=-1, total_steps=10), "warmup_steps=-1"),
    (lambda: S.warmup_cosine(warmup_steps=1, total_steps=10, min_ratio=1.5), "min_ratio=1.5"),
    (lambda: S.wsd(warmup_steps=1, total_steps=10, decay_fraction=0.0), "decay_fraction=0.0"),
    (lambda: S.wsd(warmup_steps=1, total_steps=10, decay_fraction=1.5), "decay_fraction=1.5"),
    (lambda: S.wsd(warmup_steps=1, total_steps=10, decay_fraction=0.01), "leaves no decay step"),
    (lambda: S.wsd(warmup_steps=1, total_steps=10, decay="exp"), "decay='exp'"),
    (lambda: S.wsd(warmup_steps=0, total_steps=10, min_ratio=-0.1), "min_ratio=-0.1"),
    (lambda: S.warmup_cosine(warmup_steps=1, total_steps=10)(-1), "step=-1"),
])
def test_impossible_settings_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("schedule", [
    S.constant_with_warmup(warmup_steps=5),
    S.warmup_cosine(warmup_steps=5, total_steps=40, min_ratio=0.1),
    S.wsd(warmup_steps=5, total_steps=40, decay="1-sqrt"),
])
def test_pickle_and_lambdalr_state_dict_round_trip(schedule):
    clone = pickle.loads(pickle.dumps(schedule))
    assert clone == schedule and [clone(s) for s in range(45)] == [schedule(s) for s in range(45)]
    straight = _lrs(schedule, 45)
    opt, sched = _lambda_lr(schedule)
    for _ in range(20):
        opt.step()
        sched.step()
    state = pickle.loads(pickle.dumps(sched.state_dict()))
    opt2, sched2 = _lambda_lr(pickle.loads(pickle.dumps(schedule)))
    sched2.load_state_dict(state)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # the optimizer's own state_dict carries it
    resumed = []
    for _ in range(25):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == straight[20:]


def test_extend_wsd_in_its_stable_phase():
    base = S.wsd(warmup_steps=10, total_steps=100, decay_fraction=0.2, min_ratio=0.1)
    original = _lrs(base, 100)
    opt, sched = _lambda_lr(base)
    used = []
    for _ in range(50):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    S.extend(sched, total_steps=200)
    for _ in range(150):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert used[:51] == original[:51]  # nothing already used (or current) changed
    longer = S.wsd(warmup_steps=10, total_steps=200, decay_fraction=0.2, min_ratio=0.1)
    assert sched.lr_lambdas[0] == longer
    assert used == [longer(s) for s in range(200)]
    assert all(x == 1.0 for x in used[10:longer.decay_start + 1])
    # the new length survives a state_dict round trip into a scheduler built with the old one
    # (LambdaLR.load_state_dict writes into the schedule object it holds: give it its own)
    fresh = S.wsd(warmup_steps=10, total_steps=100, decay_fraction=0.2, min_ratio=0.1)
    assert fresh(150) == pytest.approx(0.1)
    _, sched2 = _lambda_lr(fresh)
    sched2.load_state_dict(sched.state_dict())
    assert sched2.lr_lambdas[0] == longer and sched2.lr_lambdas[0](150) == 1.0


def test_extend_refuses_once_decay_has_begun_and_other_misuse():
    opt, sched = _lambda_lr(S.wsd(warmup_steps=0, total_steps=100, decay_fraction=0.2))
    with pytest.raises(ValueError, match="must exceed the current total_steps=100"):
        S.extend(sched, total_steps=100)
    for _ in range(85):
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="decay began at step 80"):
        S.extend(sched, total_steps=300)
    _, cosine = _lambda_lr(S.warmup_cosine(warmup_steps=1, total_steps=10))
    with pytest.raises(ValueError, match="built on spikeguard.schedules.wsd"):
        S.extend(cosine, total_steps=20)


def test_train_warms_up_within_a_short_run_and_says_so(tmp_path):
    from spikeguard.train import TrainConfig, train

    cfg = TrainConfig(steps=4, model="tiny", batch_size=1, eval_batches=1, warmup_steps=20,
                      out=str(tmp_path), progress=False, plot=False)
    with pytest.warns(UserWarning, match="warming up over 3 steps instead"):
        result = train(cfg, echo=False)
    assert len(result.losses) == 4
    with pytest.raises(ValueError, match="min_lr_ratio=2"):
        TrainConfig(min_lr_ratio=2)
