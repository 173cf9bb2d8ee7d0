"""The runner's client refuses a server it could never reach, at once (exit 2), instead
of trying it again for ever; and the runner's token file is checked as data."""

from __future__ import annotations

from pathlib import Path

import pytest

from kandevd import exits
from kandevd.remote.client import GatewayClient
from kandevd.remote.main import RunnerSetupError, read_token


@pytest.mark.parametrize(("server", "said"), [
    ("http://127.0.0.1:99999", "out of range"),
    ("http://127.0.0.1:port", "--server 'http://127.0.0.1:port'"),
    ("http://:7879", "a host"),
    ("ftp://x", "an http:// or https:// URL is needed"),
])
def test_a_server_url_that_cannot_be_reached_is_refused(server: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        GatewayClient(server, "kdr_x")


def test_a_ca_file_is_for_https_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--ca-file is for an https:// server"):
        GatewayClient("http://127.0.0.1:7879", "kdr_x", ca_file=str(tmp_path / "ca.pem"))


def test_a_token_file_that_is_not_text_is_a_data_error(tmp_path: Path) -> None:
    token = tmp_path / "runner.token"
    token.write_bytes(b"\xff\xfe")
    with pytest.raises(RunnerSetupError, match="not UTF-8 text") as refused:
        read_token(token)
    assert refused.value.code == exits.DATAERR
