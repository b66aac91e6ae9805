"""Per-sample seed derivation."""

from __future__ import annotations

import pytest
import torch

from fgrpo.rollout.seeds import SEED_BITS, sample_generator, sample_seed


def test_sample_seed_is_a_pure_function_of_its_keys():
    assert sample_seed(7, 3, 11) == sample_seed(7, 3, 11)
    assert 0 <= sample_seed(7, 3, 11) < 2**SEED_BITS


def test_sample_seed_separates_neighbouring_and_permuted_keys():
    keys = [(r, s, i) for r in range(3) for s in range(10) for i in range(20)]
    seeds = {sample_seed(*k) for k in keys}
    assert len(seeds) == len(keys)
    assert sample_seed(1, 2, 3) != sample_seed(3, 2, 1)
    assert sample_seed(1, 2) != sample_seed(1, 2, 0)  # the number of keys matters too


def test_sample_seed_bits_look_uniform():
    # The top bit of 2000 seeds is a fair coin: 1000 +- 5 sigma (sigma = sqrt(2000) / 2 ~ 22).
    top = sum(sample_seed(0, i) >> (SEED_BITS - 1) for i in range(2000))
    assert abs(top - 1000) < 5 * 22.4


def test_sample_seed_rejects_bad_keys():
    with pytest.raises(ValueError, match="at least one"):
        sample_seed()
    with pytest.raises(ValueError, match="64-bit"):
        sample_seed(2**64)


def test_sample_generator_is_seeded_and_checks_range():
    a = torch.randn(4, generator=sample_generator(5))
    assert torch.equal(a, torch.randn(4, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="sample_seed"):
        sample_generator(2**63)


def test_group_init_seeds_one_per_group():
    """--grpo.group-init-noise: the G samples of a group share an init seed, groups do not, a pure function of
    (seed, step), and the init seeds are not any sample's own seed."""
    from fgrpo.rollout.seeds import group_init_seeds, sample_seeds

    ids = torch.arange(12)
    s = group_init_seeds(5, 3, ids, group_size=4)
    assert s[0:4] == [s[0]] * 4 and s[4:8] == [s[4]] * 4 and s[8:12] == [s[8]] * 4
    assert len({s[0], s[4], s[8]}) == 3
    assert s == group_init_seeds(5, 3, ids, group_size=4) and s != group_init_seeds(5, 4, ids, group_size=4)
    assert group_init_seeds(5, 3, ids[4:8], group_size=4) == s[4:8]  # a rank's slice gets its groups' seeds
    assert not set(s) & set(sample_seeds(5, 3, ids))
