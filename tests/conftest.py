import os
from pathlib import Path

import pytest

from tests.faults._table import EXTERNAL, Table

ROOT = Path(__file__).resolve().parents[1]

_TABLE = pytest.StashKey[Table]()


def checkout_env() -> dict[str, str]:
    """Environment for a subprocess that must import this checkout's spikeguard, not whichever
    copy pip installed editable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture
def sub_env() -> dict[str, str]:
    """``checkout_env()`` as a fixture."""
    return checkout_env()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The recorded 50-step run (tests/test_recorded.py) takes a minute of CPU in its own pinned
    process: start it as soon as the test is known to run, so it overlaps the tests before it."""
    from tests import _recorded_run

    want = f"test_train_50_steps_losses_are_bit_identical_to_the_recording[{_recorded_run.host_capability()}]"
    if any(item.name == want for item in session.items):
        _recorded_run.start(_recorded_run.host_capability(), checkout_env())


# -- the reliability table (tests/faults; RELIABILITY.md) -----------------------------------------
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """torch on one thread for the test (bit-reproducible runs), then as it was."""
    yield from _one_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """The same for a module's shared runs, until the module's last test."""
    yield from _one_thread()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spikeguard reliability suite")
    group.addoption("--faults-full", "--full", action="store_true", dest="faults_full",
                    help="run every fault row of tests/faults many times (outside CI)")
    group.addoption("--faults-markdown", metavar="PATH",
                    help="also write the reliability table as Markdown to PATH")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_TABLE] = Table()
    config.addinivalue_line("markers", "fault_runs(ci, full): how many runs of a fault test "
                                       "(the fault_run fixture counts them) in CI and in --faults-full")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fault_run" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("fault_runs")
    ci, full = (mark.args if mark else (1, 1))
    n = full if metafunc.config.getoption("faults_full") else ci
    metafunc.parametrize("fault_run", range(n), ids=[f"run{i}" for i in range(n)])


@pytest.fixture(scope="session")
def fault_table(request: pytest.FixtureRequest) -> Table:
    """The session's reliability table: ``with fault_table.run(row) as r: ...``."""
    return request.config.stash[_TABLE]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    row = EXTERNAL.get(report.nodeid.split("[")[0])
    if row is None or not _SESSION or not (report.when == "call" or
                                           (report.when == "setup" and report.failed)):
        return
    _SESSION[0].add(row, survived=report.passed, lost=0 if report.passed else 1)


_SESSION: list[Table] = []
"""The running session's table (a test report does not carry its config)."""


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION[:] = [session.config.stash[_TABLE]]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    table = config.stash[_TABLE]
    if not table.rows:
        return
    mode = "--faults-full" if config.getoption("faults_full") else "CI runs"
    terminalreporter.write_sep("=", f"reliability table ({mode})")
    terminalreporter.write_line(table.render())
    path = config.getoption("faults_markdown")
    if path:
        Path(path).write_text(table.render(markdown=True) + "\n")
        terminalreporter.write_line(f"written to {path}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import _recorded_run

    _recorded_run.stop_all()
