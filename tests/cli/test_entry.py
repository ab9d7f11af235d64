"""The `tokcomp` console entry (`_tokcomp.py`): Ctrl-C while the package is still importing (torch, timm: seconds)
is one line and exit code 130, as docs/guarantees.md promises, and `--version` answers without importing torch."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import timm_tokcomp

pytestmark = [pytest.mark.slow]  # Ctrl-C in subprocesses

SCRIPT = Path(sys.executable).parent / "tokcomp"


def test_version_answers_without_importing_torch():
    code = ("import sys, _tokcomp\nsys.argv = ['tokcomp', '--version']\ncode = _tokcomp.main()\n"
            "assert code == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"tokcomp (timm_tokcomp) {timm_tokcomp.__version__}"


@pytest.mark.skipif(not SCRIPT.is_file() or not Path("/proc/self/maps").is_file(),
                    reason="needs the installed tokcomp script and /proc (Linux)")
def test_ctrl_c_while_importing_is_one_line_and_exit_130(tmp_path):
    """SIGINT once torch's shared library is mapped, while `import torch` (inside the entry's handler) runs."""
    proc = subprocess.Popen([str(SCRIPT), "speed", "deit_tiny_patch16_224", "--no-progress"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    assert proc.poll() is None, "tokcomp ended before torch was imported"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["tokcomp: interrupted; nothing was written (tokcomp was still starting)"], err
    assert not os.listdir(tmp_path)
