"""benchmarks/bench_link.py's pure helpers (benchmarks/harness/link.py and
the script's contender and rate parsing): the run itself needs root and a
network namespace, and is a benchmark, not a test."""
import math
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          'benchmarks')
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import bench_link  # noqa: E402
from harness import link  # noqa: E402


def test_overlap_is_zero_for_the_sum_and_one_for_the_maximum():
    assert link.overlap(0.2, 0.1, 0.3) == pytest.approx(0.0)
    assert link.overlap(0.2, 0.1, 0.2) == pytest.approx(1.0)
    assert link.overlap(0.1, 0.2, 0.25) == pytest.approx(0.5)   # the shorter one divides
    assert link.overlap(0.2, 0.1, 0.35) == pytest.approx(-0.5)  # slower than the sum
    assert link.overlap(None, 0.1, 0.2) is None
    assert link.overlap(0.0, 0.1, 0.2) is None


@pytest.mark.parametrize('text, mbit', [('200', 200.0), ('200mbit', 200.0), ('1.5gbit', 1500.0),
                                        ('800kbit', 0.8), (' 50 ', 50.0)])
def test_parse_rate(text, mbit):
    assert link.parse_rate(text) == link.Rate(f'{mbit:g} Mbit/s', mbit)


def test_parse_rates_bare_and_errors():
    assert link.parse_rates('bare,100') == [link.BARE, link.Rate('100 Mbit/s', 100.0)]
    for bad in ('fast', '0', '-5', '100mb', '', '100,100mbit'):
        with pytest.raises(ValueError):
            link.parse_rates(bad)


def test_nice_rate_keeps_two_significant_digits():
    assert [link.nice_rate(x) for x in (437.0, 96.4, 51.2, 1234.0, 7.77)] == \
        [440, 96, 51, 1200, 7.8]


def test_socket_check_lasts_about_a_second_within_bounds():
    assert link.check_bytes(200.0) == 25_000_000
    assert link.check_bytes(10.0) == 8 << 20
    assert link.check_bytes(10_000.0) == 64 << 20
    assert link.check_bytes(None) == 8 << 20


def test_calibrated_rates_scale_inversely_with_the_ratio():
    # 200 Mbit/s: reduce 100 ms, compute 200 ms (ratio 0.5 there)
    assert bench_link.calibrated_rates(200.0, 0.1, 0.2) == [200, 100, 50]
    with pytest.raises(ValueError):
        bench_link.calibrated_rates(200.0, 0.0, 0.2)


def test_closest_ratio_on_a_log_scale_within_a_factor():
    ratios = {'a': 0.4, 'b': 0.9, 'c': 2.5, 'd': None}
    assert [bench_link.closest_ratio(ratios, r) for r in (0.5, 1.0, 2.0)] == ['a', 'b', 'c']
    assert bench_link.closest_ratio({'d': None}, 1.0) is None
    # 0.48 is the ~0.5x rate only: too far from 1 (more than sqrt(2) off)
    assert bench_link.closest_ratio({'x': 0.48}, 1.0) is None
    assert bench_link.closest_ratio({'x': 0.48}, 0.5) == 'x'
    assert bench_link.closest_ratio({'x': 0.71}, 1.0) == 'x'
    assert bench_link.closest_ratio({'x': 0.30}, 0.5, within=2.0) == 'x'


def test_cluster_link_arithmetic():
    # 2 x 102.4 MB x 8 bit / (1 x 0.2 s) = 8.2 Gbit/s: 10 GbE at ~80 %
    gbit = link.cluster_link_gbit(1.0)
    assert gbit == pytest.approx(2 * 25.6e6 * 4 * 8 / 0.2 / 1e9)
    assert link.ethernet_class(gbit) == 10
    assert link.cluster_link_gbit(0.5) == pytest.approx(2 * gbit)
    assert math.isclose(link.cluster_link_gbit(2.0, compute_s=0.1), gbit)


def test_contender_variants_carry_trainer_kwargs():
    name, c = bench_link.parse_contender('ours@bucket_cap_mb=0@compression=fp16')
    assert name == 'ours@bucket_cap_mb=0@compression=fp16'
    assert (c.engine, c.loop) == ('dist_sync', 'ours')
    assert c.trainer_kwargs == {'bucket_cap_mb': 0, 'compression': 'fp16'}
    assert bench_link.CONTENDERS['ours'].trainer_kwargs == {}      # the registry untouched
    assert bench_link.parse_contender('ours-hvd@bucket_cap_mb=1')[1].engine == 'horovod'
    for bad in ('nobody', 'gluon@bucket_cap_mb=1', 'ours@=1', 'ours@cap'):
        with pytest.raises(ValueError):
            bench_link.parse_contender(bad)
