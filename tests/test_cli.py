import subprocess
import sys


def test_train_command_runs_and_reports_held_out_loss(tmp_path, sub_env):
    out = subprocess.run(
        [sys.executable, "-m", "spikeguard", "train", "--steps", "3", "--model", "tiny",
         "--batch-size", "2", "--eval-batches", "1", "--log-every", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True, env=sub_env).stdout
    assert "step     3/3" in out and "held-out loss" in out
    assert (tmp_path / "summary.json").exists()


def test_train_rejects_bad_values_with_the_option_name(sub_env):
    r = subprocess.run([sys.executable, "-m", "spikeguard", "train", "--steps", "0"],
                       capture_output=True, text=True, timeout=120, env=sub_env)
    assert r.returncode == 2 and "--steps=0" in r.stderr


def test_config_options_render_percent_signs_in_help():
    import argparse
    from dataclasses import dataclass

    from spikeguard._config_cli import add_config_args, config_from_args

    @dataclass(kw_only=True, frozen=True)
    class Cfg:
        frac: float = 0.01
        """Alert when more than 1% of updates are skipped."""

    p = argparse.ArgumentParser()
    add_config_args(p, Cfg)
    assert "1% of updates" in p.format_help()
    assert config_from_args(Cfg, p.parse_args(["--frac", "0.5"])).frac == 0.5
