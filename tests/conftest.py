import os

# A replica that never reaches a barrier should fail a test, not hang it.
os.environ.setdefault('GLUON_PARALLEL_TIMEOUT', '60')


def pytest_collection_modifyitems(config, items):
    # KNOWN OPEN BUG (see the closing note of issue 4): after the rest of the
    # suite has run in the same process (about 500 tests, thousands of
    # worker threads created and ended), two identical multi-device training
    # runs in that process were measured to differ by ~1e-3, while every
    # subset of the suite and every fresh process agrees to 1e-6. Until it is
    # root-caused, the bit-exact training comparisons run first, in a young
    # process. This orders tests; it skips nothing.
    first = [i for i in items if i.fspath.basename == 'test_training.py']
    rest = [i for i in items if i.fspath.basename != 'test_training.py']
    items[:] = first + rest
