"""The demo says how long it will take on this machine, from its cores and load (a busy 2-core machine took 29.5 min
where the idle one took 4)."""

from textsql.demo import demo_estimate


def test_an_idle_machine_gets_the_measured_figure():
    assert demo_estimate(2, 0.0) == "about 4 minutes on 2 CPU cores"


def test_a_busy_machine_is_told_longer_with_its_load():
    text = demo_estimate(2, 8.0)
    assert text.startswith("about 20 minutes at this machine's load (8.0 on 2 cores")
    assert demo_estimate(2, 3.0).startswith("about 10 minutes")


def test_one_core_is_slower_than_two():
    assert demo_estimate(1, 0.0).startswith("about 8 minutes")
