"""JSON values a request field should never have, for probing a server: each must earn a 200 or a
4xx naming the field, never a 5xx. Shared by the sweep test (tests/server/test_odd_values.py) and the
chaos clients' mutants (benchmarks/soak.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

# float32's overflow (3.5e38) and smallest subnormal (1e-45) among them
ODD_VALUES: list[Any] = [
    None, True, 0, -1, 0.5, 2, 2**64, 1e308, 3.5e38, 1e30, -1e-308, 1e-45, -0.0, math.nan,
    math.inf, "", "x", "日" * 3, [], [None], [1, "a"], {}, {"a": 1}, {"type": None}, [[[]]],
]  # fmt: skip


def variants(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``body`` with one field, at the top or one level down (in an object, or the last object of a
    list), given each odd value in turn."""
    for key, value in body.items():
        for odd in ODD_VALUES:
            yield {**body, key: odd}
        if isinstance(value, dict):
            for inner in value:
                for odd in ODD_VALUES:
                    yield {**body, key: {**value, inner: odd}}
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            for inner in value[-1]:
                for odd in ODD_VALUES:
                    yield {**body, key: [*value[:-1], {**value[-1], inner: odd}]}
