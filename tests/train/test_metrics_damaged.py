"""A damaged line of metrics.jsonl is dropped on resume with one warning naming it, not silently."""

import json
from types import SimpleNamespace

from infclip.train.logger import MetricsLogger


def test_a_damaged_line_is_dropped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3)]
    path.write_text("\n".join(records) + '\n{"step": 4, "lo')
    cfg = SimpleNamespace(wandb_mode="disabled", tensorboard=False, progress=False, every_n_steps=1)
    logger = MetricsLogger(tmp_path, cfg, True, 10, {})
    assert logger.drop_after(2) == 2  # step 3, and the line cut short
    assert path.read_text().splitlines() == records[:2]
    err = capsys.readouterr().err
    assert "metrics.jsonl: dropped 1 line(s) that are not JSON records (line 4;" in err
