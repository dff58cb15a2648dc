"""The command-line options every benchmark script takes."""
import argparse


def add_common_args(p, contenders, timeout, quick_help, contenders_help=None):
    """The options every benchmark script takes."""
    p.add_argument('--contenders', default=','.join(contenders), help=contenders_help)
    p.add_argument('--timeout', type=float, default=timeout,
                   help='seconds a worker may take to set up (warm-up included) or to run '
                        'one round before it counts as hung (default %(default)s)')
    p.add_argument('--quick', action='store_true', help=quick_help)
    p.add_argument('--json', help='write the results to this file')
    p.add_argument('--worker', action='store_true', help=argparse.SUPPRESS)
