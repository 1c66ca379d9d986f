"""The authorizer's verified-token cache: what it keeps, when it forgets, what never hits.

Pure logic with a controlled clock (the Authorizer's port). Whether a call was answered from
the cache is read from `cached_tokens` and from a count of full verifications.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable
from urllib.parse import quote_plus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.auth import Authorizer, AuthRule, Forbidden, Right, Secret, Unauthorized, sign_token
from gateway.auth.sas import _Verified
from tests.gateway.test_auth import HOST, KEYS, NOW, RULES, SKEW, FakeClock, _rule, _token, _uri

pytestmark = pytest.mark.unit


class CountingAuthorizer(Authorizer):
    """Counts full verifications (parse + HMAC): a call that does not count was a hit."""

    verifications = 0

    def _verify_header(self, sr_raw: str, meaning: tuple[str, str, str, str]) -> _Verified:
        self.verifications += 1
        return super()._verify_header(sr_raw, meaning)


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
    for same_fields in tampered[3:]:  # another spelling of the same token: a cache hit
        auth.authorize(same_fields, entity_path="orders", right=Right.SEND)
    assert auth.verifications == 1 + 3
    assert auth.cached_tokens == 1  # the valid one, whatever its spelling


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


def _spellings(token: str, n: int, seed: int = 7) -> set[str]:
    """*n* distinct headers that all parse to *token*: the scheme in any case, spaces around
    and between, the fields in any order, ``%XX`` (either hex case) for characters of ``se``,
    ``skn`` and ``sr``, and ``sr`` characters that need no encoding written out raw."""
    import random
    from urllib.parse import unquote_plus

    rng = random.Random(seed)
    fields = dict(part.split("=", 1) for part in token.split(" ", 1)[1].split("&"))
    decoded_sr = unquote_plus(fields["sr"])

    def spell(text: str, raw_ok: str) -> str:
        out = []
        for c in text:
            roll = rng.random()
            if roll < 0.3:
                out.append("%" + (f"{ord(c):02X}" if rng.random() < 0.5 else f"{ord(c):02x}"))
            elif c in raw_ok or c.isalnum():
                out.append(c)
            else:
                out.append("%" + f"{ord(c):02X}")
        return "".join(out)

    found: set[str] = set()
    while len(found) < n:
        parts = [
            f"sr={spell(decoded_sr, ':/.-_')}",
            f"sig={fields['sig']}",
            f"se={spell(fields['se'], '')}",
            f"skn={spell(fields['skn'], '-_.')}",
        ]
        rng.shuffle(parts)
        scheme = "".join(
            c.upper() if rng.random() < 0.5 else c.lower() for c in "sharedaccesssignature"
        )
        found.add(
            " " * rng.randrange(3)
            + scheme
            + " " * rng.randint(1, 3)
            + "&".join(parts)
            + " " * rng.randrange(3)
        )
    return found


def test_ten_thousand_spellings_of_one_token_are_one_cache_entry() -> None:
    auth = _authorizer(FakeClock(), size=100_000)
    token = _token("sender", "orders")
    spellings = _spellings(token, 10_000)
    assert len(spellings) == 10_000
    for header in spellings:
        principal = auth.authorize(header, entity_path="orders", right=Right.SEND)
        assert principal.resource == _uri("orders")
    assert auth.cached_tokens == 1
    assert auth.verifications == 1


def test_a_signature_over_one_raw_sr_spelling_does_not_cover_the_others() -> None:
    """A signer that put a non-canonical ``sr`` spelling under its HMAC (lower-case hex):
    that spelling verifies; another spelling of the same resource does not, cached or not."""
    key = KEYS[("sender", "primary")]
    raw_sr = quote_plus(_uri("orders")).replace("%3A", "%3a").replace("%2F", "%2f")
    sig = base64.b64encode(
        hmac.new(key.encode(), f"{raw_sr}\n{NOW + 600}".encode(), hashlib.sha256).digest()
    ).decode()
    header = f"SharedAccessSignature sr={raw_sr}&sig={quote_plus(sig)}&se={NOW + 600}&skn=sender"
    for size in (0, 100):
        auth = _authorizer(FakeClock(), size=size)
        auth.authorize(header, entity_path="orders", right=Right.SEND)
        other = header.replace(raw_sr, raw_sr.replace("%3a", "%3A"))
        with pytest.raises(Unauthorized) as err:
            auth.authorize(other, entity_path="orders", right=Right.SEND)
        assert err.value.code == "invalid_signature"
        auth.authorize(header, entity_path="orders", right=Right.SEND)


def test_the_cache_is_bounded_by_bytes_measured() -> None:
    """Distinct valid tokens with an ``sr`` near the header limit: the cache's memory, as
    tracemalloc measures it, stays under ``token_cache_bytes``."""
    import gc
    import tracemalloc

    bound = 1 << 20
    key = Secret(KEYS[("sender", "primary")])
    auth = CountingAuthorizer(
        RULES,
        [HOST],
        clock_skew=SKEW,
        clock=FakeClock(),
        token_cache_size=100_000,
        token_cache_bytes=bound,
    )
    query = "q=" + "x" * 2600
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1000):
            header = sign_token(f"{_uri('orders')}?{query}", "sender", key, NOW + 100 + i)
            assert len(header) <= 4096
            auth.authorize(header, entity_path="orders", right=Right.SEND)
            assert auth.cached_bytes <= bound
        del header
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < auth.cached_tokens < 1000  # the bytes bound, not the entry bound, evicted
    assert grown <= bound, f"the cache holds {grown} bytes, over its bound of {bound}"
    # ... and the estimate is not so pessimistic that the bound wastes most of its room.
    assert grown >= bound // 3


def test_the_cache_bytes_bound_is_validated() -> None:
    with pytest.raises(ValueError, match="token_cache_bytes"):
        Authorizer([_rule("sender", {Right.SEND}, ("orders",))], [HOST], token_cache_bytes=-1)


def _outcome(auth: Authorizer, header: str, entity: str) -> tuple[str, ...]:
    try:
        p = auth.authorize(header, entity_path=entity, right=Right.SEND)
    except (Unauthorized, Forbidden) as err:
        return (str(err.status), err.code, err.message)
    return ("ok", p.key_name, p.key_slot, p.resource, str(p.expires_at))


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    tamper=st.sampled_from(["none", "sig", "se", "skn", "sr", "raw_sr"]),
    entity=st.sampled_from(["orders", "events"]),
)
def test_property_the_cache_never_changes_an_answer(seed: int, tamper: str, entity: str) -> None:
    """A spelling or a tampering of a token that is cached answers exactly as it would with
    no cache at all."""
    import random

    token = _token("sender", "orders")
    header = next(iter(_spellings(token, 1, seed=seed)))
    rng = random.Random(seed)
    if tamper == "sig":
        sig = token.split("sig=")[1].split("&")[0]
        header = header.replace(sig, ("A" if sig[0] != "A" else "B") + sig[1:])
    elif tamper == "se":
        header = token.replace(f"se={NOW + 600}", f"se={NOW + 601}")
    elif tamper == "skn":
        header = token.replace("skn=sender", rng.choice(["skn=senders", "skn=admin", "skn=nobody"]))
    elif tamper == "sr":
        header = token.replace("orders", "events")
    elif tamper == "raw_sr":  # another spelling of sr: lower-case hex
        header = token.replace("%3A", "%3a")
    cached = _authorizer(FakeClock())
    cached.authorize(token, entity_path="orders", right=Right.SEND)  # warm
    fresh = _authorizer(FakeClock(), size=0)
    assert _outcome(cached, header, entity) == _outcome(fresh, header, entity)
