"""The authorizer's verified-token cache: what it keeps, when it forgets, what never hits.

Pure logic with a controlled clock (the Authorizer's port). Whether a call was answered from
the cache is read from `cached_tokens` and from a count of full verifications.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable

import pytest

from gateway.auth import Authorizer, AuthRule, Forbidden, Right, Secret, Unauthorized, sign_token
from gateway.auth.sas import _Verified
from tests.gateway.test_auth import HOST, KEYS, NOW, RULES, SKEW, FakeClock, _rule, _token, _uri

pytestmark = pytest.mark.unit


class CountingAuthorizer(Authorizer):
    """Counts full verifications (parse + HMAC): a call that does not count was a hit."""

    verifications = 0

    def _verify_header(self, authorization_header: str) -> _Verified:
        self.verifications += 1
        return super()._verify_header(authorization_header)


def _authorizer(
    clock: FakeClock, size: int = 100, rules: Iterable[AuthRule] = RULES
) -> CountingAuthorizer:
    return CountingAuthorizer(rules, [HOST], clock_skew=SKEW, clock=clock, token_cache_size=size)


def test_a_reused_token_is_verified_once_and_still_access_checked_every_time():
    auth = _authorizer(FakeClock())
    token = _token("sender", "")  # the namespace root: covers every entity
    for _ in range(5):
        principal = auth.authorize(token, entity_path="orders", right=Right.SEND)
        assert (principal.key_name, principal.key_slot) == ("sender", "primary")
        assert principal.resource == _uri("") and principal.expires_at == NOW + 600
    assert auth.verifications == 1 and auth.cached_tokens == 1
    # The cached verification never skips the access checks: other entity, other right.
    with pytest.raises(Forbidden) as err:
        auth.authorize(token, entity_path="audit", right=Right.SEND)
    assert err.value.code == "entity_not_allowed"
    with pytest.raises(Forbidden) as err:
        auth.authorize(token, entity_path="orders", right=Right.MANAGE)
    assert err.value.code == "missing_right"
    narrow = _token("sender", "orders")
    auth.authorize(narrow, entity_path="orders", right=Right.SEND)
    with pytest.raises(Unauthorized) as err:
        auth.authorize(narrow, entity_path="events", right=Right.SEND)
    assert err.value.code == "resource_mismatch"
    assert auth.verifications == 2


def test_an_entry_never_outlives_its_expiry_plus_the_skew():
    clock = FakeClock()
    auth = _authorizer(clock)
    token = _token("sender", "orders", expiry=NOW + 60)
    auth.authorize(token, entity_path="orders", right=Right.SEND)
    clock.now = NOW + 60 + SKEW  # the last second the full check accepts
    auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert auth.verifications == 1
    clock.now = NOW + 60 + SKEW + 0.001
    with pytest.raises(Unauthorized) as err:
        auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert err.value.code == "token_expired"
    assert auth.cached_tokens == 0


def test_replacing_the_rules_empties_the_cache_and_old_keys_stop_working():
    auth = _authorizer(FakeClock())
    token = _token("sender", "orders")
    auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert auth.cached_tokens == 1
    rotated = AuthRule(
        name="sender",
        primary_key=Secret(base64.b64encode(b"a rotated key, 32 bytes or more!").decode()),
        rights=frozenset({Right.SEND}),
        entities=("orders",),
    )
    auth.replace_rules([rotated])
    assert auth.cached_tokens == 0
    with pytest.raises(Unauthorized) as err:
        auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert err.value.code == "invalid_signature"
    fresh = sign_token(_uri("orders"), "sender", rotated.primary_key, NOW + 600)
    assert auth.authorize(fresh, entity_path="orders", right=Right.SEND).key_name == "sender"


def test_replace_rules_refuses_duplicates_and_keeps_the_current_rules():
    auth = _authorizer(FakeClock())
    with pytest.raises(ValueError, match="duplicate rule name"):
        auth.replace_rules([RULES[0], RULES[0]])
    assert auth.authorize(_token("sender", "orders"), entity_path="orders", right=Right.SEND)


def test_a_tampered_token_after_a_valid_one_never_hits():
    auth = _authorizer(FakeClock())
    token = _token("sender", "orders")
    auth.authorize(token, entity_path="orders", right=Right.SEND)
    sig_at = token.index("sig=") + 4
    tampered = [
        token[:sig_at] + ("B" if token[sig_at] == "A" else "A") + token[sig_at + 1 :],  # sig
        token.replace(f"se={NOW + 600}", f"se={NOW + 6000}"),  # a longer life
        token.replace("orders", "events"),  # another resource
        token + " ",  # the same token with a trailing space: verified on its own
        token.replace("SharedAccessSignature", "sharedaccesssignature"),
    ]
    for bad in tampered[:3]:
        with pytest.raises(Unauthorized):
            auth.authorize(bad, entity_path="orders", right=Right.SEND)
    for same_fields in tampered[3:]:  # parses to the same token: valid, but not a cache hit
        auth.authorize(same_fields, entity_path="orders", right=Right.SEND)
    assert auth.verifications == 1 + len(tampered)
    assert auth.cached_tokens == 3  # the valid one, and the two spellings of it


@pytest.mark.slow  # 100k HMAC verifications: seconds
def test_the_cache_stays_bounded_under_100k_distinct_tokens_and_evicts_the_least_recent():
    auth = _authorizer(FakeClock(), size=1000)
    key = Secret(KEYS[("sender", "primary")])
    first = sign_token(_uri("orders"), "sender", key, NOW + 1)
    auth.authorize(first, entity_path="orders", right=Right.SEND)
    for i in range(100_000):
        token = sign_token(_uri("orders"), "sender", key, NOW + 2 + i)
        auth.authorize(token, entity_path="orders", right=Right.SEND)
        if i % 500 == 0:
            auth.authorize(first, entity_path="orders", right=Right.SEND)  # kept recent
        assert auth.cached_tokens <= 1000
    assert auth.cached_tokens == 1000
    done = auth.verifications
    auth.authorize(first, entity_path="orders", right=Right.SEND)
    auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert auth.verifications == done  # both still cached
    auth.authorize(
        sign_token(_uri("orders"), "sender", key, NOW + 2), entity_path="orders", right=Right.SEND
    )
    assert auth.verifications == done + 1  # long evicted


def test_size_zero_verifies_every_request_and_refusals_are_never_cached():
    auth = _authorizer(FakeClock(), size=0)
    token = _token("sender", "orders")
    for _ in range(3):
        auth.authorize(token, entity_path="orders", right=Right.SEND)
    assert auth.verifications == 3 and auth.cached_tokens == 0
    cached = _authorizer(FakeClock())
    wrong = _token("sender", "orders", key=KEYS[("admin", "primary")])
    for _ in range(2):
        with pytest.raises(Unauthorized):
            cached.authorize(wrong, entity_path="orders", right=Right.SEND)
    assert cached.cached_tokens == 0 and cached.verifications == 2


def test_the_cache_size_is_validated():
    with pytest.raises(ValueError, match="token_cache_size"):
        Authorizer([_rule("sender", {Right.SEND}, ("orders",))], [HOST], token_cache_size=-1)
