"""A request and a response over WSGI, with the headers every console answer carries."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

#: Form bodies larger than MAX_BODY are refused (a schedule with its messages fits easily).
from kandevd.net.httpintake import MAX_BODY

#: No script but the console's own file, nothing from another origin, no framing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    # (same-origin, not no-referrer: under no-referrer a browser sends "Origin: null" with
    # the console's own form posts, and the CSRF check could not tell them from a page
    # of no origin, such as a sandboxed frame or a local file)
    ("Referrer-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
]


class BadRequest(Exception):
    """The request cannot be read (too large, not a form): answered 400 or 413."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Request:
    """What a view needs of the WSGI environ: method, path, query, form, cookies."""

    def __init__(self, environ: dict[str, Any]) -> None:
        self.environ = environ
        self.method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        raw_path = str(environ.get("PATH_INFO", "/")) or "/"
        # WSGI hands the path as latin-1 decoded bytes: back to UTF-8.
        try:
            self.path = raw_path.encode("latin-1").decode("utf-8")
        except UnicodeError:
            self.path = raw_path
        self.query = _first(parse_qs(str(environ.get("QUERY_STRING", "")),
                                     keep_blank_values=True))
        self.query_lists = parse_qs(str(environ.get("QUERY_STRING", "")),
                                    keep_blank_values=True)
        self._form: dict[str, list[str]] | None = None

    def header(self, name: str) -> str | None:
        key = "HTTP_" + name.upper().replace("-", "_")
        if name.lower() == "content-type":
            key = "CONTENT_TYPE"
        value = self.environ.get(key)
        return str(value) if value is not None else None

    @property
    def cookies(self) -> dict[str, str]:
        """The request's cookies (the first of each name)."""
        found: dict[str, str] = {}
        for name, value in self._cookie_pairs():
            found.setdefault(name, value)
        return found

    def cookie_values(self, wanted: str) -> list[str]:
        """Every value sent under ``wanted`` (a browser sends each cookie of the name that
        applies: another path's or another program's too)."""
        return [value for name, value in self._cookie_pairs() if name == wanted]

    def _cookie_pairs(self) -> list[tuple[str, str]]:
        """Read by hand: a malformed cookie of another program on the same host (cookies
        are not kept apart by port) spoils only itself."""
        pairs = []
        for part in (self.header("Cookie") or "").split(";"):
            name, sep, value = part.strip().partition("=")
            if sep and name:
                pairs.append((name, value.strip().strip('"')))
        return pairs

    def form_lists(self) -> dict[str, list[str]]:
        """The url-encoded body of a POST (BadRequest when it is not one or too large)."""
        if self._form is not None:
            return self._form
        content_type = (self.header("Content-Type") or "").split(";")[0].strip().lower()
        if self.header("Transfer-Encoding"):
            raise BadRequest("a form needs a Content-Length", 411)
        try:
            length = int(self.environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise BadRequest("bad Content-Length") from None
        if length > MAX_BODY:
            raise BadRequest(f"the form is larger than {MAX_BODY} bytes", 413)
        body = self.environ["wsgi.input"].read(length) if length > 0 else b""
        if body and content_type != "application/x-www-form-urlencoded":
            raise BadRequest("only url-encoded forms are accepted")
        try:
            # (strict: %ff percent-encoded is refused as raw bytes are, never stored as
            # a replacement character)
            self._form = parse_qs(body.decode("utf-8"), keep_blank_values=True,
                                  errors="strict")
        except UnicodeDecodeError:
            raise BadRequest("the form is not UTF-8") from None
        return self._form

    @property
    def form(self) -> dict[str, str]:
        return _first(self.form_lists())

    def url(self, **changes: Any) -> str:
        """This page's path with its query changed (None drops a parameter)."""
        params = {**self.query, **{k: v for k, v in changes.items()}}
        kept = {k: v for k, v in params.items() if v not in (None, "")}
        return quote(self.path) + (("?" + urlencode(kept)) if kept else "")


def _first(lists: dict[str, list[str]]) -> dict[str, str]:
    return {key: values[0] for key, values in lists.items() if values}


class Response:
    """A status, headers and a body (bytes, or an iterator for a stream)."""

    def __init__(self, body: bytes | str | Iterable[bytes] = b"", status: int = 200, *,
                 content_type: str = "text/html; charset=utf-8",
                 headers: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.body = body.encode("utf-8") if isinstance(body, str) else body
        self.headers = [("Content-Type", content_type), *(headers or [])]

    def set_cookie(self, name: str, value: str, *, max_age: int | None = None,
                   path: str = "/", secure: bool = False) -> None:
        parts = [f"{name}={value}", f"Path={path}", "HttpOnly", "SameSite=Strict"]
        if secure:
            parts.append("Secure")
        if max_age is not None:
            parts.append(f"Max-Age={max_age}")
        self.headers.append(("Set-Cookie", "; ".join(parts)))

    def wsgi(self, start_response: Any) -> Iterable[bytes]:
        phrase = HTTPStatus(self.status).phrase
        headers = [*self.headers, *SECURITY_HEADERS]
        if not any(name == "Cache-Control" for name, _ in headers):
            headers.append(("Cache-Control", "no-store"))
        if isinstance(self.body, bytes):
            headers.append(("Content-Length", str(len(self.body))))
            start_response(f"{self.status} {phrase}", headers)
            return [self.body]
        start_response(f"{self.status} {phrase}", headers)
        return self.body


def redirect(location: str, status: int = 303) -> Response:
    return Response(b"", status, headers=[("Location", location)])


def text(message: str, status: int) -> Response:
    return Response(message + "\n", status, content_type="text/plain; charset=utf-8")


def stream(chunks: Iterator[bytes]) -> Response:
    """A server-sent event stream."""
    return Response(chunks, 200, content_type="text/event-stream; charset=utf-8",
                    headers=[("X-Accel-Buffering", "no")])
