"""The pure decisions behind the console's intake: when a request is whole, and which
listen addresses need TLS."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kandevd.net.httpintake import BadFraming, Gathering, request_size
from kandevd.net.listen import WebConfig, remote_problem
from kandevd.web.http import MAX_BODY, BadRequest, Request


def test_a_request_is_whole_with_its_headers_and_its_body() -> None:
    head = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n"
    assert request_size(head[:-2]) is None
    assert request_size(head) == len(head) + 5
    # a length is read as cheroot reads it (the name stripped, in any case): its body
    # is gathered here, not waited for in a worker
    for spaced in (b"Content-Length : 5", b"content-LENGTH:5 "):
        other = b"POST /x HTTP/1.1\r\nHost: a\r\n" + spaced + b"\r\n\r\n"
        assert request_size(other) == len(other) + 5
    assert request_size(head + b"abcde" + b"GET / HTTP/1.1\r\n") == len(head) + 5
    bare = b"GET / HTTP/1.1\r\n\r\n"
    assert request_size(bare) == len(bare)


@pytest.mark.parametrize("headers", [
    b"Content-Length: %d\r\n" % (MAX_BODY + 1),  # too large: cheroot answers 413 unread
    b"Transfer-Encoding: chunked\r\n",             # no length: answered without the body
])
def test_a_request_that_will_be_refused_is_whole_at_its_headers(headers: bytes) -> None:
    head = b"POST / HTTP/1.1\r\n" + headers + b"\r\n"
    assert request_size(head) == len(head)


@pytest.mark.parametrize("headers", [
    # cheroot took the last of two lengths (or "+100" as 100) and read a body that
    # never came in a worker thread: anonymous clients could hold every worker
    b"Content-Length: 1\r\nContent-Length: 100000\r\n",
    b"Content-Length: 5\r\nContent-Length: 5\r\n",
    b"Content-Length: +100\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: 1e3\r\n",
    "Content-Length: \uff15\r\n".encode(),  # a digit, but not an ASCII one
    b"Host: a\r\nHost: b\r\n",                 # which one was meant? (RFC 9112: 400)
    b"content-length: 1\r\nCONTENT-LENGTH: 100000\r\n",
    b"X-A: 1\r\n" * 101 + b"Content-Length: 1\r\nContent-Length: 100000\r\n",  # > 100
    b"X-A: 1\r\n folded\r\n",                    # obsolete line folding (RFC 9112: 400)
    b"no colon here\r\n",
])
def test_a_request_whose_length_or_host_is_ambiguous_is_bad_framing(headers: bytes) -> None:
    for data in (b"POST /login HTTP/1.1\r\n" + headers + b"\r\n",
                 bytearray(b"POST /login HTTP/1.1\r\n" + headers + b"\r\n")):  # (as gathered)
        with pytest.raises(BadFraming):
            request_size(data)


@given(st.binary(max_size=300))
def test_request_size_never_fails_and_never_asks_for_more_than_a_body(data: bytes) -> None:
    try:
        size = request_size(data)
    except BadFraming:
        with pytest.raises(BadFraming):  # (as gathered: a bytearray, the same answer)
            request_size(bytearray(data))
        return  # (answered 400 at once)
    assert request_size(bytearray(data)) == size
    if size is not None:
        assert 0 < size <= len(data) + MAX_BODY


@pytest.mark.parametrize(("listen", "tls", "insecure", "refused"), [
    ("127.0.0.1:7878", False, False, False),
    ("[::1]:7878", False, False, False),
    ("localhost:0", False, False, False),
    ("0.0.0.0:7878", False, False, True),
    ("192.168.1.5:7878", False, False, True),
    ("console.example:443", False, False, True),
    ("0.0.0.0:7878", True, False, False),
    ("0.0.0.0:7878", False, True, False),
    (None, False, False, False),
])
def test_off_loopback_a_listener_needs_tls_or_consent(listen: str | None, tls: bool,
                                                     insecure: bool, refused: bool) -> None:
    problem = remote_problem("web", listen, tls, insecure)
    assert (problem is not None) == refused
    if refused:
        assert problem is not None and problem.startswith("web.listen:")


def test_a_certificate_needs_its_key() -> None:
    assert "set both" in (WebConfig("127.0.0.1:1", tls_cert="c.pem").problem() or "")
    assert WebConfig("0.0.0.0:1", tls_cert="c.pem", tls_key="k.pem").problem() is None


def test_the_oldest_gathering_connection_makes_room() -> None:
    class Conn:
        def __init__(self) -> None:
            self.ended = False

        def end_gathering(self) -> None:
            self.ended = True

    gathering = Gathering(limit=2)
    first, second, third = Conn(), Conn(), Conn()
    gathering.begin(first, 1.0)  # type: ignore[arg-type]
    gathering.begin(second, 2.0)  # type: ignore[arg-type]
    gathering.begin(first, 1.0)  # (still gathering: keeps its place)
    gathering.begin(third, 3.0)  # type: ignore[arg-type]
    assert first.ended and not second.ended and not third.ended
    gathering.done(second)  # type: ignore[arg-type]
    assert len(gathering) == 1


@pytest.mark.parametrize("body", [b"name=%ff%fe%80", b"messages=%c3%28", b"name=\xff"])
def test_a_form_that_is_not_utf8_is_refused_raw_or_percent_encoded(body: bytes) -> None:
    """(Percent-encoded, it was stored as U+FFFD in workflow.json.)"""
    request = Request({"REQUEST_METHOD": "POST", "PATH_INFO": "/schedules/new",
                       "CONTENT_TYPE": "application/x-www-form-urlencoded",
                       "HTTP_CONTENT_TYPE": "application/x-www-form-urlencoded",
                       "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body)})
    with pytest.raises(BadRequest, match="the form is not UTF-8"):
        request.form_lists()
