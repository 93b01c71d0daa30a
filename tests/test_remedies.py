"""The remedies a Tier 2 page suggests (guard/remedies.py): QK-norm or QK-Clip when the attention
logits' bound grew past Kimi K2's threshold, a z-loss when log Z fired, the LR when the update's
own size jumped; from the rules' reasons and the guard's own readings, on real runs too."""

import pytest
from benchmarks.zoo import _job
from benchmarks.zoo_run import run_one

import spikeguard as sg
from spikeguard.guard.remedies import remedies
from spikeguard.guard.summary import History, tier2_summary

CFG = sg.DetectorConfig()


def _history(bounds, config=CFG):
    h = History(32, config)
    for s in range(60):
        h.add(s, 3.0, 1.0, 5.0)
    for s, b in bounds:
        h.add_bound(s, b)
    return h


def _summary(h, reasons=("grad_norm > 3x median",)):
    return tier2_summary(h, step=59, reasons=reasons, onset=55, data_range=(55, 59),
                         rollback_to=50)


@pytest.mark.parametrize("first, last, advised", [
    (15.0, 5000.0, True),     # the attention-logit proxy: 300x, far past 100
    (12.0, 88.0, False),      # a healthy small Llama after 300 steps: under 100
    (12.0, 150.0, True),      # past 100 and 12.5x its start
    (20.0, 150.0, False),     # past 100 but 7.5x: a loose bound that was large from the start
    (7.0, 7.1, False)])       # QK-norm: flat
def test_the_attention_remedy_needs_the_bound_past_100_and_10x_its_start(first, last, advised):
    h = _history([(0, first), (10, (first + last) / 2), (50, last)])
    s = _summary(h)
    assert s["attn_logit_bound"] == {"first": [0, first], "last": [50, last],
                                     "max": [50, last]}
    text = [r for r in s["remedies"] if r.startswith("attention logits")]
    assert bool(text) == advised
    if advised:
        assert "QK-norm" in text[0] and "--set qk_clip=100" in text[0]
        assert f"{last:,.0f} at step 50" in text[0] and f"{first:,.0f} at step 0" in text[0]


def test_the_thresholds_are_the_configs_fields():
    cfg = sg.DetectorConfig(qk_advice_bound=50.0, qk_advice_growth=2.0)
    h = _history([(0, 20.0), (50, 60.0)], cfg)
    assert any(r.startswith("attention logits") for r in _summary(h)["remedies"])
    assert not any(r.startswith("attention logits")
                   for r in _summary(_history([(0, 20.0), (50, 60.0)]))["remedies"])
    with pytest.raises(ValueError, match="qk_advice_bound"):
        sg.DetectorConfig(qk_advice_bound=-1.0)


def test_the_reasons_name_their_remedy():
    assert remedies(["log_z > median of last 32 + 1"], [], None, CFG)[0].startswith(
        "output logits")
    assert "z_loss=1e-4" in remedies(["log_z +3 within 10 steps"], [], None, CFG)[0]
    lr = remedies(["lr jump: lr 0.09 is 49.6x the last step's 0.0018 (bar 4)",
                   "update_ratio > 20x median"], [], None, CFG)
    assert len(lr) == 1 and lr[0].startswith("the LR itself jumped")
    assert remedies(["update_ratio > 20x median"], [], None, CFG)[0].startswith(
        "the update's own size")
    assert remedies(["grad_norm > 3x median", "loss > median + 6 spreads"], [], None, CFG) == []
    # no bounds read (signals off): no attention line and no bound in the summary
    s = _summary(_history([]))
    assert s["attn_logit_bound"] is None and s["remedies"] == []


def test_the_bounds_survive_a_resume_and_a_replay_and_an_old_state_loads():
    h = _history([(0, 15.0), (10, 900.0), (20, float("nan")), (30, 2000.0)])
    assert [b for _, b in h.bounds] == [15.0, 900.0, 2000.0]  # a non-finite reading is left out
    g = History(32, CFG)
    g.load_state_dict(h.state_dict())
    assert list(g.bounds) == list(h.bounds) and g.first_bound == (0, 15.0)
    g.add_bound(20, 500.0)  # a replay from step 20 after a rollback drops the later readings
    assert list(g.bounds) == [(0, 15.0), (10, 900.0), (20, 500.0)]
    old = {k: v for k, v in h.state_dict().items() if k in ("window", "rows")}
    g.load_state_dict(old)
    assert not g.bounds and g.first_bound is None and len(g.rows) == 32


@pytest.fixture(scope="module")
def first_pages():
    """The first Tier 2 summary of each natural proxy (tiny GPT, LR 1.0, 300 steps, seed 0):
    without QK-norm (attention logits), and with it but without z-loss (output logits)."""
    out = {}
    for name in ("attn-logit", "output-logit"):
        records: list = []
        run_one(_job("natural", f"natural/{name}", name, 0, "alert"), records)
        out[name] = next(r["summary"] for r in records if r.get("tier") == 2)
    return out


def test_the_attention_logit_proxys_page_names_qk_norm_and_the_output_logits_page_z_loss(
        first_pages):
    attn, output = first_pages["attn-logit"], first_pages["output-logit"]
    assert any(r.startswith("attention logits") for r in attn["remedies"])
    assert attn["attn_logit_bound"]["last"][1] > 100 * attn["attn_logit_bound"]["first"][1]
    assert not any(r.startswith("attention logits") for r in output["remedies"])
    assert any(r.startswith("output logits") for r in output["remedies"])
    assert output["attn_logit_bound"]["max"][1] < CFG.qk_advice_bound


def _attn_rollback(seed, **guard):
    records: list = []
    line = run_one(_job("natural", "natural/attn-logit", "attn-logit", seed, "rollback",
                        tier2="rollback", guard=guard), records)
    return line, records


def test_the_rollback_turns_qk_clip_on_at_the_rollback_and_the_bound_holds_after_it():
    _, records = _attn_rollback(0)  # GuardConfig.rollback_qk_clip is on by default
    on = [r for r in records if r.get("qk_clip") is not None]
    assert [r["qk_clip"] for r in on] == [100.0]  # once, at the first rollback that names it
    assert on[0]["action"] == "rollback"
    assert any(x.startswith("attention logits") for x in on[0]["summary"]["remedies"])
    # QK-Clip holds each head's bound under 100 after every update from the replay on
    after = [r["attn_logit_bound"] for r in records[records.index(on[0]) + 1:]
             if r.get("attn_logit_bound") is not None]
    assert len(after) > 20 and max(after) <= 100.0 * (1 + 1e-6)
    before = [r["attn_logit_bound"] for r in records[:records.index(on[0])]
              if r.get("attn_logit_bound") is not None]
    assert max(before) > 1000.0
    # rollback_qk_clip=False leaves the recipe alone: the bound keeps growing
    _, plain = _attn_rollback(0, rollback_qk_clip=False)
    assert not any(r.get("qk_clip") is not None for r in plain)
    assert max(r["attn_logit_bound"] for r in plain if r.get("attn_logit_bound")) > 1000.0


def test_a_resume_keeps_the_qk_clip_a_rollback_turned_on():
    import torch

    def guard():
        torch.manual_seed(0)
        model = sg.GPT(sg.GPTConfig.tiny(vocab_size=64, qk_norm=False))
        return sg.Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    a, b = guard(), guard()
    assert a.control.qk_clip is None and a.probes.signals.config.qk_clip is None
    before = a.state_dict()
    assert a.control.qk_clip_on(100.0) is None  # what the rollback does
    assert a.probes.signals.config.qk_clip == 100.0
    b.load_state_dict(a.state_dict())  # the guard's state as a checkpoint holds it: a resume
    assert b.control.qk_clip == 100.0 and b.probes.signals.config.qk_clip == 100.0
    a.load_state_dict(before)  # a rollback restores a state saved before: it stays on
    assert a.probes.signals.config.qk_clip == 100.0
    model = sg.GPT(sg.GPTConfig.tiny(vocab_size=64, qk_norm=False))
    blind = sg.Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), probes=False)
    assert "signals" in blind.control.qk_clip_on(100.0) and blind.control.qk_clip is None
    with pytest.raises(ValueError, match="rollback_qk_clip"):
        sg.GuardConfig(rollback_qk_clip="yes")


def test_the_end_table_says_a_rollback_turned_qk_clip_on():
    import io

    from rich.console import Console

    from spikeguard.train.report import ProgressSink, summary_table

    console = Console(file=io.StringIO(), width=200)
    sink = ProgressSink(console, total=10, start=0, tokens_per_step=64, bar=False,
                        print_every=100)
    for step in range(10):
        sink.log({"action": "rollback", "rollback_to": 0, "qk_clip": 100.0} if step == 7
                 else {"action": "continue"}, step)
    console.print(summary_table(sink, applied=9, made_up=0, rollbacks=1, val_loss=2.0,
                                seconds=1.0, halted=False))
    out = console.file.getvalue()
    assert "QK-Clip turned on by the rollback at step 7" in out and "100" in out
    quiet = ProgressSink(Console(file=io.StringIO()), total=1, start=0, tokens_per_step=1,
                         bar=False, print_every=100)
    quiet.log({"action": "continue"}, 0)
    table = Console(file=io.StringIO(), width=200)
    table.print(summary_table(quiet, applied=1, made_up=0, rollbacks=0, val_loss=2.0,
                              seconds=1.0, halted=False))
    assert "QK-Clip" not in table.file.getvalue()


def test_the_page_offers_the_rollback_with_the_remedys_setting(tmp_path):
    from spikeguard.oncall.ask import answer_commands
    from spikeguard.oncall.settings import parse_setting, split_setting

    s = _summary(_history([(0, 15.0), (50, 5000.0)]))
    assert s["remedy_settings"] == ["qk_clip=100"]
    answers = answer_commands(tmp_path, "59-abcdef", s)
    assert answers["rollback_with_remedy"] == answers["rollback"] + " --set qk_clip=100"
    assert "--to 50 --skip-data 55:59" in answers["rollback"]
    assert parse_setting(*split_setting("qk_clip=100"), layers=[]) == ("qk_clip", 100.0)
    quiet = _summary(_history([(0, 12.0), (50, 88.0)]), reasons=("log_z +3 within 10 steps",))
    assert quiet["remedy_settings"] == [] and quiet["remedies"]  # a z-loss line, no setting
    assert "rollback_with_remedy" not in answer_commands(tmp_path, "59-abcdef", quiet)
