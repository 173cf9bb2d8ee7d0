"""Who may use the console: a token kept in the home, a cookie, CSRF and Host checks.

The token (``<home>/web.token``, mode 0600) is created once. A browser hands
it over once, by POST (``/login``: the page ``kandevd web open`` writes, or
the sign-in form) or in a URL (``?token=``, for an SSH tunnel; that URL stays
in the browser's history), and gets a cookie (``HttpOnly``,
``SameSite=Strict``, ``Secure`` over HTTPS) named for the console's port:
cookies are not kept apart by port, so another program on this host setting
a cookie of its own cannot shadow ours. The cookie and the CSRF token are
HMACs of the token: nothing is kept per browser, and a new token (delete the
file, restart) signs every browser out.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from pathlib import Path

TOKEN_FILE = "web.token"
#: How long a one-time sign-in code (``kandevd web open``) may wait to be used.
CODE_TTL_S = 120.0


def login_code(token: str, now: float | None = None) -> str:
    """A code that signs one browser in once, within :data:`CODE_TTL_S`: what ``kandevd
    web open``'s page posts instead of the token, so a browser that keeps the POST (to
    restore the page) keeps only a spent code."""
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(8)
    return f"{stamp}.{nonce}.{_code_mac(token, stamp, nonce)}"


def _code_mac(token: str, stamp: str, nonce: str) -> str:
    return hmac.new(token.encode(), f"login:{stamp}.{nonce}".encode(), hashlib.sha256
                    ).hexdigest()[:32]
#: Names that always reach this machine only: a DNS-rebinding page cannot use them.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def token_path(home: Path) -> Path:
    return Path(home) / TOKEN_FILE


def read_token(home: Path) -> str | None:
    """The console's token, or None when none was made yet (or it is unreadable)."""
    try:
        text = token_path(home).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def ensure_token(home: Path) -> str:
    """The console's token, created (mode 0600) when there is none.

    Written whole to a file of its own, then linked to its name: a reader never
    sees half a token, and of two processes making one at once the first wins. An
    empty or unreadable token file is replaced by a new token. Raises OSError."""
    existing = read_token(home)
    if existing is not None:
        return existing
    token = secrets.token_urlsafe(32)
    path = token_path(home)
    spare = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(token + "\n")
        try:
            os.link(spare, path)
        except FileExistsError:
            again = read_token(home)
            if again is not None:
                return again  # made meanwhile (a CLI and the daemon at once): theirs wins
            os.replace(spare, path)  # an empty or broken token file
        return token
    finally:
        spare.unlink(missing_ok=True)


def split_host(header: str) -> str | None:
    """The name of a ``Host`` header (``name[:port]``, ``[v6][:port]``), lowercased."""
    header = header.strip().lower()
    if not header:
        return None
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        rest = header[end + 1:]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return header[1:end]
    name, sep, port = header.partition(":")
    if sep and not port.isdigit():
        return None
    return name or None


class Guard:
    """The checks every request passes; built from the token and the names served."""

    def __init__(self, token: str, listen_host: str, allowed_hosts: tuple[str, ...] = (),
                 *, port: int = 0, secure: bool = False) -> None:
        self._token = token
        #: The session cookie's and the one-time message's names: this console's own.
        self.cookie_name = f"kandevd_console_{port}"
        self.flash_cookie = f"kandevd_flash_{port}"
        #: Cookies only over HTTPS (the console serves TLS).
        self.secure = secure
        # (an entry with a port means its name: any port is served)
        names = set(LOOPBACK_NAMES) | {split_host(h) or h.lower() for h in allowed_hosts}
        if listen_host not in ("0.0.0.0", "::", ""):
            names.add(listen_host.lower())
        self.hosts = frozenset(names)
        self._spent: dict[str, float] = {}  # nonce -> when it expires
        self._spent_lock = threading.Lock()
        self.cookie_value = self._mac("cookie")
        self.csrf_token = self._mac("csrf")

    def _mac(self, purpose: str) -> str:
        return hmac.new(self._token.encode(), purpose.encode(), hashlib.sha256).hexdigest()

    def sign(self, value: str) -> str:
        """A MAC of ``value`` (the flash message cookie)."""
        return hmac.new(self._token.encode(), b"flash:" + value.encode(), hashlib.sha256
                        ).hexdigest()[:32]

    def signed(self, value: str, mac: str) -> bool:
        return hmac.compare_digest(self.sign(value).encode(), mac.encode())

    def host_allowed(self, header: str | None) -> bool:
        """A ``Host`` the console serves (no DNS rebinding: an attacker's name is refused)."""
        name = split_host(header or "")
        return name is not None and name in self.hosts

    def token_matches(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(candidate.encode(),
                                                             self._token.encode())

    def redeem(self, code: str, now: float | None = None) -> bool:
        """Is ``code`` a :func:`login_code` of our token, in time and not used before?"""
        now = time.time() if now is None else now
        stamp, _, rest = code.partition(".")
        nonce, _, mac = rest.partition(".")
        if not (stamp.isdigit() and nonce and mac) or abs(now - int(stamp)) > CODE_TTL_S:
            return False
        if not hmac.compare_digest(mac.encode(), _code_mac(self._token, stamp, nonce).encode()):
            return False
        with self._spent_lock:
            for old in [n for n, until in self._spent.items() if until < now]:
                del self._spent[old]
            if nonce in self._spent:
                return False
            self._spent[nonce] = int(stamp) + CODE_TTL_S + 1
        return True

    def cookie_matches(self, candidates: list[str]) -> bool:
        """Does any of the values sent under our cookie's name match (a browser sends every
        cookie of that name that applies, another program's among them)?"""
        wanted = self.cookie_value.encode()
        return any(hmac.compare_digest(value.encode(), wanted) for value in candidates)

    def csrf_matches(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(candidate.encode(),
                                                             self.csrf_token.encode())
