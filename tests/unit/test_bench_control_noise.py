"""wattserve/bench/control_noise.py: tokens and joules by window, and the spreads it reports."""

import math

import pytest

from wattserve.bench.control_noise import (
    NORMALIZED_MIN_WINDOWS,
    energy_between,
    main,
    tokens_between,
    window_spread,
    windows_needed,
)
from wattserve.sim.run import Sample


def test_tokens_are_spread_from_first_to_last_token():
    # First token at 1 s, ten more over the next second.
    requests = [(0.0, 1.0, 0.1, 11), (5.0, None, None, 0)]
    assert tokens_between(requests, 0.0, 1.5) == pytest.approx(6.0)
    assert tokens_between(requests, 1.5, 3.0) == pytest.approx(5.0)
    assert tokens_between(requests, 3.0, 9.0) == 0.0


def test_energy_sums_each_sample_over_the_span_before_it():
    # Sample i, at 0.1 i s, is the mean power over (0.1 (i - 1), 0.1 i]: 150 W from 0.5 s.
    samples = [
        Sample(0.1 * i, 100.0 + (50.0 if i > 5 else 0.0), 300.0, 50.0, 345, 0, 0) for i in range(21)
    ]
    assert energy_between(samples, 0.0, 0.5) == pytest.approx(50.0)
    assert energy_between(samples, 0.5, 1.0) == pytest.approx(
        0.5 * 150.0
    )  # samples 6-10 cover (0.5, 1.0]
    assert energy_between(samples, 0.25, 0.35) == pytest.approx(10.0)


def test_idle_removed_spread_is_zero_when_energy_is_idle_plus_per_token():
    window_s, idle_w, per_token = 30.0, 85.0, 0.2
    tokens = [900.0, 1100.0, 700.0, 1300.0, 1000.0, 800.0, 1200.0]
    windows = [(idle_w * window_s + per_token * k, k) for k in tokens]
    run_j = sum(e for e, _ in windows) / sum(tokens)
    row = window_spread(windows, window_s, run_j)
    assert row["windows"] == len(tokens)
    assert row["raw_spread_pct"] > 5.0  # the idle share per token swings with the load
    assert row["idle_w"] == pytest.approx(idle_w, abs=0.1)
    assert row["j_per_token_over_idle"] == pytest.approx(per_token, abs=1e-4)
    assert row["normalized_spread_pct"] == pytest.approx(0.0, abs=1e-6)


def test_idle_removed_spread_needs_enough_windows_and_sees_noise():
    tokens = [900.0, 1100.0, 700.0, 1300.0, 1000.0, 800.0, 1200.0, 950.0]
    noise = [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5]
    windows = [(2550.0 + 0.2 * k * (1 + 0.02 * z), k) for k, z in zip(tokens, noise, strict=True)]
    row = window_spread(windows, 30.0, 2.75)
    assert 0.0 < row["normalized_spread_pct"] < 10.0
    few = window_spread(windows[: NORMALIZED_MIN_WINDOWS - 1], 30.0, 2.75)
    assert "raw_spread_pct" in few and "normalized_spread_pct" not in few


def test_windows_needed_for_a_gap_two_standard_errors_clear():
    # sd of the difference of two n-window means: s * sqrt(2 / n) <= gap / 2.
    n = windows_needed(1.5, 1.5)
    assert n == 8
    assert 1.5 * math.sqrt(2.0 / n) <= 1.5 / 2 + 1e-12
    assert 1.5 * math.sqrt(2.0 / (n - 1)) > 1.5 / 2
    assert windows_needed(0.1, 9.0) == 1
    with pytest.raises(ValueError):
        windows_needed(1.0, 0.0)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--windows-s", "10,0"], "every window must be > 0 s"),
        (["--windows-s", "10,x"], "not a comma list of numbers"),
        (["--gap-pct", "0"], "--gap-pct must be > 0"),
        (["--warmup-s", "400"], "shorter than --duration-s"),
        (["--scenario", "nope"], "one of steady30"),
        (["--setting", "bf16:435"], "not level:clock:seqs:tokens:interval"),
        (["--budget-w", "0"], "power_budget_w must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv, says, capsys):
    # A zero window would never end the loop that cuts the run into windows.
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
