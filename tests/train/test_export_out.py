"""python -m infclip.export with an unusable --out is one line (exit 2), checked before any work."""

import pytest

from infclip.export import main


@pytest.mark.parametrize("make_out", [
    lambda t: (t / "file").write_text("x") and t / "file",  # an existing regular file
    lambda t: (t / "file").write_text("x") and t / "file" / "sub",  # a path through a regular file
])
def test_an_unusable_out_is_one_line_before_any_work(tmp_path, capsys, make_out):
    out = make_out(tmp_path)
    assert main([str(tmp_path / "no-such-run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {out} cannot be used as the output folder (") and len(err.splitlines()) == 1
    assert "Traceback" not in err


def test_a_malformed_run_config_is_an_export_error(tmp_path):
    from infclip.export import ExportError, _run_model_config

    (tmp_path / "config.yaml").write_text("model: [broken\n")
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    with pytest.raises(ExportError, match=r"config.yaml cannot be read as the run's configuration.*--model NAME"):
        _run_model_config(tmp_path / "checkpoints" / "step_00000001", None)
