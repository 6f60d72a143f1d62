"""Synchronizer shards: the assignment policy, the config field, the capacity plan's use of it (issue 40)."""

import hashlib
import json

import pytest

from diloco_async.capacity.sizes import shard_fragments
from diloco_async.config.schema import Config, _training_dict, config_hash, load_config
from diloco_async.policy.rounds import schedule_rounds
from diloco_async.policy.shards import assignment, fragments_of, shard_of


@pytest.mark.parametrize(("shards", "num_fragments"), [(1, 1), (1, 4), (2, 4), (3, 4), (3, 7), (4, 4), (5, 16)])
def test_every_fragment_has_exactly_one_shard_and_the_shards_agree(shards, num_fragments):
    owned = assignment(shards, num_fragments)
    assert sorted(p for frags in owned.values() for p in frags) == list(range(num_fragments))
    for i, frags in owned.items():
        assert frags, f"shard {i} owns nothing"
        assert all(shard_of(p, shards) == i for p in frags)
        assert frags == fragments_of(i, shards, num_fragments)
    assert max(map(len, owned.values())) - min(map(len, owned.values())) <= 1


def test_the_assignment_is_p_mod_s():
    assert assignment(3, 7) == {0: [0, 3, 6], 1: [1, 4], 2: [2, 5]}
    assert shard_of(5, 2) == 1 and shard_of(0, 3) == 0


@pytest.mark.parametrize(("shard", "shards", "num_fragments", "named"), [
    (2, 2, 4, "shard 2 is outside"), (-1, 2, 4, "shard -1"), (0, 5, 4, "synchronizer.shards=5 exceeds"),
    (0, 0, 4, "synchronizer.shards=0")])
def test_bad_shards_are_refused_naming_the_value(shard, shards, num_fragments, named):
    with pytest.raises(ValueError, match=named):
        fragments_of(shard, shards, num_fragments)


def test_the_capacity_plan_uses_the_synchronizers_assignment():
    for s, p in [(1, 4), (2, 4), (3, 8), (4, 9)]:
        assert shard_fragments(p, s) == [fragments_of(i, s, p) for i in range(s)]
    with pytest.raises(ValueError, match="exceeds"):
        shard_fragments(2, 3)


def test_config_refuses_more_shards_than_fragments():
    with pytest.raises(ValueError, match=r"synchronizer\.shards=5 exceeds synchronizer\.num_fragments=4"):
        load_config(None, ["synchronizer.num_fragments=4", "synchronizer.shards=5"])
    with pytest.raises(ValueError, match="shards"):
        load_config(None, ["synchronizer.shards=0"])
    assert load_config(None, ["synchronizer.num_fragments=4", "synchronizer.shards=4"]).synchronizer.shards == 4


def test_shards_is_a_training_field_and_s1_hashes_as_before_shards_existed():
    one, two = load_config(None), load_config(None, ["synchronizer.shards=2"])
    assert config_hash(one) != config_hash(two)
    # a config dict written before the field existed (an old run's config.json) hashes as S = 1 does
    old = one.public_dict()
    del old["synchronizer"]["shards"]
    assert config_hash(Config.model_validate(old)) == config_hash(one)
    # what a run recorded before the field existed: the hash of a training dict without it
    recorded = hashlib.sha256(json.dumps(_training_dict(old), sort_keys=True, separators=(",", ":")).encode())
    assert config_hash(one) == recorded.hexdigest()


def test_a_shard_schedules_its_own_fragments_at_the_whole_plans_offsets():
    full = schedule_rounds(g=5, next_rounds=[1, 1, 1, 1], busy=(), waiting=(), free_slots=4,
                           sync_every=4)
    mine = schedule_rounds(g=5, next_rounds={1: 1, 3: 1}, busy=(), waiting=(), free_slots=4,
                           sync_every=4, num_fragments=4)
    # offsets floor(p * 4 / 4) = p: at g = 5 fragments 0 and 1 are due (round 1 at 4 + p); fragment 1 at
    # the offset of a 2-fragment plan (2) would not be
    assert full.open_now == ((0, 1), (1, 1))
    assert mine.open_now == ((1, 1),)
