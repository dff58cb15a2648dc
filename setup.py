"""Everything is in setup.cfg but the start-up hook: gluon_parallel_numpy_compat.pth
goes to site-packages, where Python runs it at start-up (the numpy names
mxnet 1.9.1 reads must be there before a user's own ``import mxnet``; see
gluon_parallel_numpy_compat.py). setuptools has no option for a file at the
top of site-packages, so its build and editable-wheel commands are extended:
``pip install .`` and ``pip install -e .`` both install the hook."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = 'gluon_parallel_numpy_compat.pth'
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    """build_py, and the hook beside the packages (the wheel's top)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


def editable_wheel_with_pth():
    """setuptools' editable_wheel (PEP 660), whose wheel gets the hook too:
    its default strategies write only their own path hooks, so the hook is
    added to the wheel the strategy writes."""
    from setuptools.command.editable_wheel import editable_wheel

    class WithPth:
        def __init__(self, strategy):
            self.strategy = strategy

        def __enter__(self):
            self.strategy.__enter__()
            return self

        def __exit__(self, *exc):
            return self.strategy.__exit__(*exc)

        def __call__(self, wheel, files, mapping):
            self.strategy(wheel, files, mapping)
            with open(os.path.join(HERE, PTH)) as f:
                wheel.writestr(PTH, f.read())

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return WithPth(super()._select_strategy(*args, **kwargs))

    return EditableWheelWithPth


setup(cmdclass={'build_py': BuildPyWithPth, 'editable_wheel': editable_wheel_with_pth()})
