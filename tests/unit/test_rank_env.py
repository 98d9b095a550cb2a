"""Rank processes import this checkout's code, and the test fakes under tests/ too."""

from pathlib import Path

from transfer.serving.ranks.ranks import ROOT, rank_env


def test_rank_env_puts_the_checkout_first_on_pythonpath():
    root = Path(ROOT)
    assert (root / "transfer" / "__init__.py").is_file()
    assert (root / "tests" / "__init__.py").is_file()
    assert rank_env()["PYTHONPATH"].split(":")[0] == ROOT
