"""docs/open_clip_options.md stays in sync with open_clip_train's parser and with our schema."""

import inspect
import re
from pathlib import Path

import open_clip_train.params as params

from infclip.config import TrainConfig, _schema_keys

DOC = Path(__file__).resolve().parents[1] / "docs" / "open_clip_options.md"


def rows() -> dict[str, str]:
    """open_clip option -> the InfCLIP column of its row."""
    found = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`--"):
            found[cells[0].strip("`")] = cells[1]
    return found


def test_every_open_clip_option_has_a_row():
    options = set(re.findall(r"""["'](--[a-z0-9-]+)["']""", inspect.getsource(params)))
    assert len(options) > 60
    table = rows()
    assert sorted(options - set(table)) == [], "options without a row in docs/open_clip_options.md"
    assert sorted(set(table) - options) == [], "rows for options open_clip_train does not have"


def test_every_key_named_exists_in_the_schema():
    keys = set(_schema_keys(TrainConfig))
    named = {cell.strip("`") for cell in rows().values() if cell != "—"}
    assert named and sorted(named - keys) == []
