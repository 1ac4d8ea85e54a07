"""A pairwise cut of parametrized tests: of each test function's cases, keep the fewest (greedily)
such that every pair of parameter values, and every single value, appears in a kept case.

Combinatorial testing's rule of thumb is that most defects need one or two parameters to
coincide; the full grid stays the long tier (``scripts/gpu_tests/run.sh --full``). Cases are
only ever *selected* from those collected, so a grid's own skips and exclusions still hold.
Parameters are compared by ``repr`` of their values (dtypes, tuples and strings alike).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations


def case_values(item) -> tuple[tuple[str, str], ...]:
    """(name, repr(value)) of the case's parameters, in name order; () for a plain test."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return ()
    return tuple(sorted((name, repr(value)) for name, value in spec.params.items()))


def covered(values: tuple) -> set:
    """The single values and value pairs one case exercises."""
    singles = {(v,) for v in values}
    return singles | set(combinations(values, 2))


def pairwise_subset(items: list) -> list:
    """The kept items, in collection order: per test function, the greedy pairwise cover.

    Greedy: repeatedly keep the case covering the most still-uncovered pairs (ties: the
    earlier case). Each function keeps at least one case; unparametrized tests are kept.
    """
    groups: dict = defaultdict(list)
    for item in items:
        groups[item.nodeid.split("[")[0]].append(item)
    kept = set()
    for cases in groups.values():
        kept.update(id(c) for c in _cover(cases))
    return [item for item in items if id(item) in kept]


def _cover(cases: list) -> list:
    todo = set().union(*(covered(case_values(c)) for c in cases))
    chosen = []
    while todo or not chosen:
        best = max(cases, key=lambda c: len(covered(case_values(c)) & todo))
        chosen.append(best)
        todo -= covered(case_values(best))
    return chosen
