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


def test_budget_with_an_unknown_model_is_one_line_not_a_traceback():
    import subprocess
    import sys

    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "spikeguard", "budget", "foo"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "'foo' is neither" in r.stderr
