"""infclip.records: a run's JSON-lines records, read without torch."""

import subprocess
import sys

from infclip.records import read_records


def test_cut_and_non_object_lines_are_left_out_and_an_absent_file_has_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n[1, 2]\n"text"\n{"step": 2, "loss": 3.5}\n{"step": 3, "lo')
    assert read_records(path) == [{"step": 1}, {"step": 2, "loss": 3.5}]
    assert read_records(tmp_path / "absent.jsonl") == []
    assert read_records(tmp_path) == []  # a folder is not a records file


def test_reading_records_does_not_import_torch():
    code = "import sys; from infclip.records import read_records; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
