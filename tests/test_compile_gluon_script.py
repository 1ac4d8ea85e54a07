"""scripts/compile_gluon_sm90.py refuses a --triton folder that does not hold triton 3.6 in
one paragraph with exit status 2 (before compiling anything)."""

import subprocess
import sys
from pathlib import Path

import triton

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_gluon_sm90.py"


def test_a_folder_without_triton_36_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--triton", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    if triton.__version__.startswith("3.6"):  # this environment's own triton is 3.6: nothing to refuse
        assert proc.returncode != 2 or "3.6" not in proc.stderr
        return
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "triton==3.6.0" in proc.stderr and triton.__version__ in proc.stderr
