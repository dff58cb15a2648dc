"""The suite's own set-up (conftest.py at the top): a machine where mxnet
cannot be imported (Python 3.13 after the 3.11 command) is told what to
install instead of failing test by test."""
import pathlib
import subprocess
import sys

TOP = pathlib.Path(__file__).resolve().parent.parent


def test_a_missing_mxnet_stops_the_run_with_the_line_that_installs_it(tmp_path):
    hide = tmp_path / 'hide_mxnet.py'
    hide.write_text("import sys\nsys.modules['mxnet'] = None\n")
    proc = subprocess.run([sys.executable, '-c',
                           f'exec(open({str(hide)!r}).read()); import pytest, sys; '
                           f'sys.exit(pytest.main(["-q", "--co", "-p", "no:cacheprovider", '
                           f'{str(TOP / "tests" / "test_split.py")!r}]))'],
                          cwd=TOP, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert 'pip install --no-deps mxnet==1.9.1' in proc.stdout + proc.stderr
