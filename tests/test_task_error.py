"""task_error: the error Parallel.get() raises for a task's exception is
of the task's own type and a ParallelTaskError, with the task's args and
attributes; what cannot be rebuilt so is raised itself, with a note."""
import pickle

import pytest

from gluon_parallel.task_error import ParallelTaskError, task_error


class Coded(Exception):
    """An __init__ that formats its argument (args differ from the call's)."""

    def __init__(self, code):
        super().__init__(f'failed with code {code}')
        self.code = code


class TwoArguments(Exception):
    """Cannot be rebuilt from its args (as pickle cannot)."""

    def __init__(self, what, where):
        super().__init__(what)
        self.where = where


def raised(exc):
    try:
        raise exc
    except BaseException as e:
        return e


@pytest.mark.parametrize('exc', [ValueError('bad value'), KeyError('key'),
                                 FileNotFoundError(2, 'no such file', 'a.txt'), Coded(7),
                                 UnicodeDecodeError('utf-8', b'\xff', 0, 1, 'invalid byte')],
                         ids=lambda e: type(e).__name__)
def test_the_error_is_the_tasks_type_and_a_parallel_task_error(exc):
    original = raised(exc)
    err = task_error(original, 'the message', ctx='cpu(1)', index=3, dropped=1)
    assert err is not original
    assert isinstance(err, type(exc)) and isinstance(err, ParallelTaskError)
    assert type(err).__name__ == type(exc).__name__
    assert str(err) == 'the message'
    assert err.args == original.args
    assert (err.exception, err.ctx, err.index, err.dropped) == (original, 'cpu(1)', 3, 1)
    assert vars(original).items() <= vars(err).items()       # its attributes (Coded.code)
    for attr in ('errno', 'filename', 'code', 'reason', 'start'):
        assert getattr(err, attr, None) == getattr(original, attr, None)
    back = pickle.loads(pickle.dumps(err))        # as the task's own exception would be
    assert type(back) is type(exc) and back.args == pickle.loads(pickle.dumps(original)).args


def test_what_cannot_be_rebuilt_is_raised_itself_with_a_note():
    for exc in (TwoArguments('no box', 'cpu(1)'), KeyboardInterrupt()):
        original = raised(exc)
        err = task_error(original, 'in Parallel task 3', ctx='cpu(1)', index=3, dropped=0)
        assert err is original and err.__notes__ == ['in Parallel task 3']
        assert not isinstance(err, ParallelTaskError)
