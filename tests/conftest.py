import os

# A replica that never reaches a barrier should fail a test, not hang it.
os.environ.setdefault('GLUON_PARALLEL_TIMEOUT', '60')

