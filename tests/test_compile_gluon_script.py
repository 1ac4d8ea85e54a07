"""The Gluon dev scripts refuse bad input in one paragraph with exit status 2, before any work:
scripts/tools/compile_gluon_sm90.py a --triton folder without triton 3.6, the GPU checks
(check_gluon_fwd.py, check_gluon_strip.py) a machine without a CUDA device."""

import subprocess
import sys
from pathlib import Path

import triton

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "compile_gluon_sm90.py"


def test_a_folder_without_triton_36_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--triton", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    if triton.__version__.startswith("3.6"):  # this environment's own triton is 3.6: nothing to refuse
        assert proc.returncode != 2 or "3.6" not in proc.stderr
        return
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "triton==3.6.0" in proc.stderr and triton.__version__ in proc.stderr


def test_the_gpu_checks_refuse_a_machine_without_cuda():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the checks would run (run them there: python scripts/tools/check_gluon_fwd.py)")
    for name, args in (("check_gluon_fwd.py", ["--quick"]), ("check_gluon_strip.py", ["--quick"])):
        proc = subprocess.run([sys.executable, str(SCRIPT.parent / name), *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "no CUDA device" in proc.stderr


def test_check_gluon_fwd_refuses_bad_options_before_any_work():
    """--sizes / --dims take positive integers, --flip a count >= 0: argparse's one line, exit 2."""
    for args, name in ((["--sizes", "0"], "--sizes"), (["--dims", "x,512"], "--dims"), (["--flip", "-1"], "--flip")):
        proc = subprocess.run([sys.executable, str(SCRIPT.parent / "check_gluon_fwd.py"), *args], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"argument {name}:" in proc.stderr and "Traceback" not in proc.stderr
