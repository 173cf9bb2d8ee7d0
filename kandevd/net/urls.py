"""The store's URL as it may be shown: never with its password (logs, errors, status)."""

from __future__ import annotations

import re

#: The URL schemes ``store.url`` takes (PostgreSQL's two spellings).
POSTGRES_SCHEMES = ("postgresql", "postgres")


_USERINFO_SECRET = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*:)[^/?#]*@")
_QUERY_SECRET = re.compile(r"(?i)([?&](?:password|passfile|sslpassword)=)[^&#]*")


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***`` (for logs and error messages).

    Both places a libpq URL can carry one are masked: ``user:password@`` and a
    ``password=`` query parameter. Something that is not a URL at all (a
    ``key=value`` connection string) is not shown.
    """
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", url):
        return "<not a URL>"
    return _QUERY_SECRET.sub(r"\1***", _USERINFO_SECRET.sub(r"\1***@", url))


#: The password of a URL's userinfo (``scheme://user:PASSWORD@``), found without parsing.
_USERINFO_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^:/@?#]*:([^@]*)@")
_QUERY_PASSWORD = re.compile(r"(?i)[?&](?:password|passfile|sslpassword)=([^&#]*)")


def scrub_secrets(text: str, url: str) -> str:
    """``text`` (a driver's error message about ``url``) on one line, every secret masked.

    A driver may quote the URL, or only the token it could not parse (a
    password with a bad ``%`` escape): every form of the URL's password,
    as written and percent-decoded, becomes ``***``, and so does any URL
    with userinfo the text quotes. Never parses ``url`` (a URL too broken
    to parse may still hold a password).
    """
    from urllib.parse import unquote

    text = "; ".join(line.strip() for line in str(text).splitlines() if line.strip())
    secrets: set[str] = set()
    for pattern in (_USERINFO_PASSWORD, _QUERY_PASSWORD):
        for match in pattern.finditer(url):
            secrets.update((match.group(1), unquote(match.group(1))))
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s?#]*:)[^@\s]*@", r"\1***@", text)
