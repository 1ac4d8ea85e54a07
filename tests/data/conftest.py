"""Fixtures for the data tests (helpers live in data_helpers.py)."""

import pytest

from data_helpers import write_shards


@pytest.fixture
def shards(tmp_path):
    """shards(sizes, name="shards", **kw) -> shard paths under tmp_path/name."""
    def make(sizes, name="shards", **kw):
        return write_shards(tmp_path / name, sizes, **kw)
    return make
