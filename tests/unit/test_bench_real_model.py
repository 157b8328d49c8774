"""bench/real_model.py and bench/grpo.py without training anything: the paired bootstrap that tells GRPO's gain from
noise, and the parts --only accepts."""

import pytest

from bench.grpo import paired_bootstrap
from bench.real_model import PARTS, TRAINED, main


def test_the_paired_bootstrap_s_difference_and_interval():
    before = [True] * 50 + [False] * 50
    after = [True] * 45 + [False] * 5 + [True] * 15 + [False] * 35  # 15 gained, 5 lost: +10 points
    result = paired_bootstrap(before, after, samples=500)
    assert result["difference"] == pytest.approx(0.10)
    assert (result["questions_gained"], result["questions_lost"]) == (15, 5)
    low, high = result["interval_95"]
    assert low < 0.10 < high and high - low < 0.25
    same = paired_bootstrap(before, before, samples=200)
    assert same["difference"] == 0 and same["interval_95"] == [0, 0]


def test_only_takes_the_comparison_s_parts(capsys):
    assert set(TRAINED) < set(PARTS) and {"zero_shot", "decoding", "merged", "quantized"} < set(PARTS)
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "full,lora_everything"])
    assert exit_.value.code == 2 and "not lora_everything" in capsys.readouterr().err
