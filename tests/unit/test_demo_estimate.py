"""Every run (the demo's too) says how long its training takes on this machine from the time its own first steps took
(a constant scaled by the load said 10 minutes where the causal demo trained for over 100)."""

import pytest

from textsql.train.estimate import TrainingTimer, describe_estimate, training_estimate_s


def test_the_estimate_is_the_measured_step_times_the_steps_plus_the_evaluations_forward_passes():
    # 8 evaluations of 600 questions in batches of 64: 10 batches, 640 examples, 40 steps of 16, a third of a step each
    assert training_estimate_s(0.1, 1504, 8, 600, 16, 64) == pytest.approx(150.4 + 8 * 40 * 0.1 / 3)
    assert training_estimate_s(0.1, 100, 0, 600, 16, 64) == pytest.approx(10.0)


def test_the_text_says_what_was_timed_and_about_how_long_it_takes():
    text = describe_estimate(245.0, 0.15, 6, 45, 3.14, 2)
    assert text.startswith("timed here: 150 ms a step over steps 6-45 (load 3.1 on 2 cores)")
    assert "the training takes about 4 minutes in all, evaluations included" in text
    assert "about 45 s in all" in describe_estimate(45.0, 0.01, 1, 4, 0.0, 2)


def test_a_short_run_is_timed_before_it_ends():
    timer = TrainingTimer(print, eval_examples=600)
    assert timer.window(1504) == (50, 50)
    assert timer.window(20) == (2, 4) and timer.window(1) == (0, 1)
