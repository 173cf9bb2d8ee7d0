"""A self-signed certificate for localhost and 127.0.0.1 (openssl), for the HTTPS tests."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificate(folder: Path, name: str = "console") -> tuple[Path, Path]:
    """``(certificate, key)`` PEM files in ``folder``; the certificate is its own CA."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key
