"""One contract, every registered policy: residency bookkeeping under the owner protocol."""

from __future__ import annotations

import random

import pytest

from kvtier.errors import ConfigError
from kvtier.policies.admission import Admission, AdmissionConfig
from kvtier.policies.registry import POLICIES, make_policy

NAMES = POLICIES.names()


@pytest.fixture(params=NAMES)
def factory(request):
    """Builds a fresh policy of one kind."""
    return lambda hint=None: make_policy(request.param, capacity_hint=hint)


def test_empty_policy_has_no_victim(factory):
    policy = factory()
    assert len(policy) == 0
    assert policy.victim() is None
    assert "a" not in policy


def test_insert_access_remove(factory):
    policy = factory(10)
    for key in "abc":
        policy.miss(key)
        policy.insert(key, 1)
    policy.access("b")
    assert len(policy) == 3 and all(k in policy for k in "abc")
    assert policy.victim() in {"a", "b", "c"}
    policy.remove("b")
    assert "b" not in policy and len(policy) == 2
    policy.remove("zzz")  # unknown keys are ignored
    policy.remove("b")
    assert len(policy) == 2


def test_victim_does_not_evict(factory):
    policy = factory(4)
    for key in range(4):
        policy.insert(key, 1)
    first = policy.victim()
    assert first in policy and len(policy) == 4
    assert policy.victim() == first  # asking twice names the same key


def test_draining_by_victim_empties_the_policy(factory):
    policy = factory(8)
    for key in range(8):
        policy.insert(key, 1 + key % 3)
        if key % 2:
            policy.access(key)
    seen = set()
    while len(policy):
        v = policy.victim()
        assert v in policy and v not in seen
        seen.add(v)
        policy.remove(v)
    assert seen == set(range(8)) and policy.victim() is None


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ConfigError, match="valid: " + ", ".join(NAMES)):
        make_policy("clock")


def test_unknown_option_is_a_config_error():
    with pytest.raises(ConfigError, match="bad option"):
        make_policy("lru", nonsense=1)


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_match_a_residency_model(factory, seed):
    """The owner loop with random sizes and deletions; the policy must agree with a plain dict."""
    rng = random.Random(seed)
    capacity = 40
    policy = factory(capacity)
    resident: dict[int, int] = {}
    for _ in range(3000):
        key = rng.randrange(60)
        op = rng.random()
        if op < 0.1:  # an explicit delete, resident or not
            policy.remove(key)
            resident.pop(key, None)
        elif key in policy:
            assert key in resident
            policy.access(key)
        else:
            assert key not in resident
            size = rng.randint(1, 5)
            policy.miss(key)
            if not policy.admit(key, size):
                continue
            while sum(resident.values()) + size > capacity:
                v = policy.victim()
                assert v in resident, "victim must be resident"
                policy.remove(v)
                del resident[v]
            policy.insert(key, size)
            resident[key] = size
        assert len(policy) == len(resident)
    assert all(k in policy for k in resident)


def test_admission_off_by_default_admits_everything():
    adm = Admission()
    assert all(adm.admit(k, prefix_chunks=0) for k in range(10))


def test_admission_min_prefix_and_doorkeeper():
    adm = Admission(AdmissionConfig(enabled=True, min_prefix_chunks=2, doorkeeper=True, doorkeeper_keys=4))
    assert not adm.admit("short", prefix_chunks=1)
    assert not adm.admit("k1", prefix_chunks=3)  # first sighting
    assert adm.admit("k1", prefix_chunks=3)  # second sighting
    for k in range(8):  # two generations later "k1" is forgotten
        adm.admit(k)
    assert not adm.admit("k1")
    assert adm.rejected == 3 + 8


def test_admission_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="min_prefix_chunks"):
        AdmissionConfig(min_prefix_chunks=-1)
