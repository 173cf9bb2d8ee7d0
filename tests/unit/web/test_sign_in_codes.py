"""One-time sign-in codes (``kandevd web open``): good once, in time, for this token only."""

from __future__ import annotations

from kandevd.web.auth import CODE_TTL_S, Guard, login_code


def test_a_code_signs_in_once() -> None:
    guard = Guard("secret-token", "127.0.0.1")
    code = login_code("secret-token", now=1000.0)
    assert guard.redeem(code, now=1001.0)
    assert not guard.redeem(code, now=1002.0)  # spent


def test_a_late_forged_or_foreign_code_signs_nobody_in() -> None:
    guard = Guard("secret-token", "127.0.0.1")
    assert not guard.redeem(login_code("secret-token", now=1000.0), now=1000.0 + CODE_TTL_S + 1)
    assert not guard.redeem(login_code("another-token", now=1000.0), now=1000.0)
    stamp, nonce, mac = login_code("secret-token", now=1000.0).split(".")
    assert not guard.redeem(f"{stamp}.{nonce}x.{mac}", now=1000.0)
    for junk in ("", ".", "..", "x.y.z", "1000..", "secret-token"):
        assert not guard.redeem(junk, now=1000.0)
