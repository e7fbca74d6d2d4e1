"""Property: no hostile copy of a recording makes compare, inspect or the replay read path crash, hang or lie.

One small recording set (a 2-layer MLP with a dropout: reference, replay target with local data, plain second
recording, statistics-level recording) is made once per session; hypothesis mutates copies of them
(`mutants.CATEGORIES`: bit flips, attribute values/types/deletions, dataset deletion, datasets replaced by groups,
soft links, external links or strings, external raw storage, virtual datasets, judged values scaled far beyond
tolerance; then the structures a reader walks: parent cycles, a second group for one call, a second /stats row,
/stats and /local numbers out of range or contradicting each other, a call's local rows deleted, a replay's
accumulated entries scaled under clean local rows, /random ops that disagree with their names or count, numbers at
their limits, rank file names, and call tensors' layouts a replay would allocate by) and every mutant must give exit
0, 1 or 2 (2: one line on stderr), no traceback, no hang (a SIGALRM per example), and never exit 0 when it changed
what is judged or forged a structure (`mutants.MUST_NOT_MATCH`). A summary per category is printed at the end of the
session (`pytest -s`); `bench/mutations.py` runs the same generators with more examples, each in a forked child.
"""

from __future__ import annotations

import collections
import faulthandler
import os

import mutants
import pytest
from hypothesis import HealthCheck, given, settings

EXAMPLES = {  # 1,281 in all. Small spaces (40 datasets to turn into groups, ...) are given no more than they hold:
    # hypothesis stops a category once its distinct mutations are exhausted
    "bit_flip": 200, "attr_value": 80, "attr_type": 110, "attr_missing": 60, "delete": 75, "to_group": 40,
    "to_soft_link": 110, "to_external_link": 100, "to_string": 140, "external_storage": 60, "virtual": 30,
    "scale_values": 40,
    # the structures a reader walks: 236 more, each space small (a few dozen distinct mutations)
    "parent_cycle": 24, "duplicate_call": 14, "duplicate_stats": 10, "stats_values": 28, "local_values": 34,
    "local_deleted": 18, "scale_entries": 28, "random_ops": 14, "limits": 14, "rank_names": 10, "layouts": 12,
    "steps": 30,  # a multi-step recording's structures: its 30 mutations (`mutants.STEPS_MUTATIONS`)
}
assert sum(EXAMPLES.values()) >= 1235 and set(EXAMPLES) == set(mutants.CATEGORIES)
SCALE = float(os.environ.get("ONEITER_MUTATION_SCALE", "1"))  # e.g. 0.1 for a quick local run

TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
pytestmark = pytest.mark.slow  # 1,281 hostile files, each through compare, inspect and the replay read path


@pytest.fixture(scope="session")
def pair(mlp_pair):
    return mlp_pair  # the MLP recordings, made once per session (conftest)


@pytest.fixture(scope="session", autouse=True)
def _summary():
    yield
    if TALLY:
        print("\nmutation cases per category (outcome: count):")
        for category in mutants.CATEGORIES:
            print(f"  {category:18} {dict(TALLY[category])}")


def _property(category: str):
    @settings(max_examples=max(1, int(EXAMPLES[category] * SCALE)), deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(data=__import__("hypothesis").strategies.data())
    def test(pair, tmp_path, data):
        mutation = data.draw(mutants.strategy(pair, category))
        mutant = mutants.apply(pair, mutation, tmp_path / "mutant.h5", tmp_path)
        faulthandler.dump_traceback_later(120, exit=True)  # a hang inside C code: fail loudly, never stall CI
        try:
            found = mutants.check(pair, mutation, mutant, timeout=30)
        finally:
            faulthandler.cancel_dump_traceback_later()
        result = mutants.outcome(found)
        TALLY[category][result] += 1
        TALLY[category]["exit 2"] += found.get("compare_exit") == 2
        assert result == "clean", (mutation, found)
        assert found["compare_exit"] in (0, 1, 2) and found["inspect_exit"] in (0, 1, 2)
        if mutation.judged_change:
            assert found["compare_exit"] != 0, (mutation, found)
        if mutation.category in ("to_external_link", "external_storage", "virtual", "to_group", "to_string",
                                 "parent_cycle", "duplicate_call", "duplicate_stats", "stats_values",
                                 "local_deleted", "rank_names", "layouts"):
            # these are refused when the file is opened, whatever reads it
            assert found["compare_exit"] == 2 and found["inspect_exit"] == 2, (mutation, found)
            assert found["compare_stderr"].count("\n") == 1 and found["inspect_stderr"].count("\n") == 1

    test.__name__ = f"test_mutants_{category}"
    return test


for _category in mutants.CATEGORIES:
    globals()[f"test_mutants_{_category}"] = _property(_category)


def test_at_least_1000_mutants_were_tried():
    """Runs after the categories above (file order): they tried as many mutants as asked, 1,000 or more."""
    if SCALE != 1 or set(TALLY) != set(mutants.CATEGORIES):
        pytest.skip("only meaningful after a full run of every category")
    tried = {c: sum(n for k, n in TALLY[c].items() if k != "exit 2") for c in mutants.CATEGORIES}
    assert sum(tried.values()) >= 1150, tried
    assert all(TALLY[c]["clean"] == tried[c] for c in mutants.CATEGORIES)
