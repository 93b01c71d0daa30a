"""Bad input to every name in ``spikeguard.__all__`` and to the building blocks the table
imports from their modules (tests/faults/_bad_input.py holds the table): each call raises the expected error, its message holds the words that name the problem,
and the objects it was given are the same after it as before."""

import re
import warnings
from itertools import count

import pytest

import spikeguard as sg
from tests.faults import _bad_input
from tests.faults._bad_input import CASES, NOT_CALLED
from tests.faults._bad_objects import same as _same
from tests.faults._bad_objects import snapshot

_N = count()


def _tmp_factory(tmp_path_factory):
    return lambda: tmp_path_factory.mktemp(f"bad{next(_N)}")


_ALL = CASES(lambda: None)  # for the ids and the coverage check only


def test_every_public_name_has_bad_input_or_a_reason_it_takes_none():
    covered = {c.name for c in _ALL} | set(NOT_CALLED)
    # a case of a name outside the public API tests a building block the table imports
    stale = {n for n in covered - set(sg.__all__) if n not in vars(_bad_input)}
    assert not set(sg.__all__) - covered and not stale, (
        f"no case for {sorted(set(sg.__all__) - covered)}; stale: {sorted(stale)}")


@pytest.mark.parametrize("index", range(len(_ALL)), ids=[f"{c.name}: {c.what}" for c in _ALL])
def test_bad_input_gets_a_clear_error_and_changes_nothing(index, fault_table, tmp_path_factory):
    case = CASES(_tmp_factory(tmp_path_factory))[index]
    with fault_table.run("bad input to every public name") as run:
        objects = case.setup()
        before = snapshot(case.state(objects)) if case.state else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(case.raises) as err:
                case.call(objects)
        message = str(err.value)
        missing = [w for w in case.match if w not in message]
        stray = [w for w in caught if case.warns is None or not issubclass(w.category, case.warns)]
        changed = case.state is not None and not _same(before, snapshot(case.state(objects)))
        run.held = not missing and not stray and not changed
        # one line a person can act on: no bare internal error text
        run.held &= len(message) < 2000 and not re.match(r"^'?\w+'? object has no attribute", message)
    assert run.held, (f"{case.name}: {case.what}: {type(err.value).__name__}: {message!r}; "
                      f"missing words {missing}; stray warnings {[str(w.message) for w in stray]}; "
                      f"state changed: {changed}")
