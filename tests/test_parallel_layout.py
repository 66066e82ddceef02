"""RankLayout's errors speak in library terms; the trainer's in its own options (no --stages)."""

from __future__ import annotations

import pytest

from sparsepipe_hpc.parallel.layout import LayoutError, RankLayout
from sparsepipe_hpc.train.config import ConfigError, parse_config, resolve_layout


def test_grid_that_does_not_divide_the_world_names_no_command_line_option():
    with pytest.raises(LayoutError) as info:
        RankLayout.from_world(6, grid=(2, 2, 1))
    assert str(info.value) == ("grid (2, 2, 1) uses 4 ranks per replica, which does not divide "
                               "the 6 ranks of the job; choose a grid whose product divides 6, "
                               "or start a multiple of 4 ranks")
    with pytest.raises(LayoutError) as info:
        RankLayout.from_world(6, grid=(2, 1, 1), stages=2)
    assert str(info.value) == ("grid (2, 1, 1) x 2 stages uses 4 ranks per replica, which does "
                               "not divide the 6 ranks of the job; choose a grid and a stage count "
                               "whose product divides 6, or start a multiple of 4 ranks")
    assert RankLayout.from_world(8, grid=(2, 1, 1), stages=2).replicas == 2


def test_trainer_names_its_own_option_and_not_one_it_lacks():
    with pytest.raises(ConfigError) as info:
        resolve_layout(parse_config(["--grid", "2,2,1", "--batch-size", "4"]), 6)
    message = str(info.value)
    assert message == ("--grid 2,2,1 uses 4 ranks per replica, which does not divide the 6 ranks "
                       "of the job; pass a --grid whose product divides 6, or start a multiple "
                       "of 4 ranks")
    assert "stage" not in message
