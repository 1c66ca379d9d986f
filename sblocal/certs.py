"""A self-signed TLS certificate for the broker's HTTPS management endpoint.

The real `ServiceBusAdministrationClient` has no emulator mode: it always speaks HTTPS to
`https://<fully_qualified_namespace>/...`. The broker therefore serves its management API over
TLS with a certificate that tests and developers trust explicitly, by passing the certificate
file to the client as its CA bundle (azure-core's `connection_verify=<cert path>`).

The certificate is self-signed, valid for `localhost` and `127.0.0.1`, and written once per
directory: later calls reuse it while it is valid, so a developer can trust it once.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import ipaddress
import logging
import os
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_log = logging.getLogger(__name__)

CERT_FILE_NAME = "sblocal-dev-cert.pem"
KEY_FILE_NAME = "sblocal-dev-key.pem"
_LOCK_FILE_NAME = ".sblocal-dev-cert.lock"

_DNS_NAMES = ("localhost",)
_IP_ADDRESSES = (ipaddress.IPv4Address("127.0.0.1"),)
_VALIDITY = dt.timedelta(days=365)
# Regenerate a little before expiry so that a long test run never sees the certificate lapse.
_RENEW_MARGIN = dt.timedelta(days=1)


def ensure_dev_cert(directory: Path) -> tuple[Path, Path]:
    """Return ``(cert_path, key_path)`` of a usable development certificate in `directory`.

    Creates the directory and the certificate when missing; reuses an existing pair when it is
    still valid, matches its key and covers ``localhost`` and ``127.0.0.1``; regenerates it
    otherwise. Safe to call from several processes at once (an exclusive file lock serialises
    the check-and-write; both files are replaced atomically). The key file is readable by its
    owner only. Raises OSError if the directory cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / CERT_FILE_NAME
    key_path = directory / KEY_FILE_NAME
    with _exclusive_lock(directory / _LOCK_FILE_NAME):
        if _is_usable(cert_path, key_path):
            return cert_path, key_path
        cert_pem, key_pem = _generate()
        # Key first: a reader that finds the new certificate always finds its key.
        _atomic_write(key_path, key_pem, mode=0o600)
        _atomic_write(cert_path, cert_pem, mode=0o644)
        _log.info("wrote development certificate %s", cert_path)
    return cert_path, key_path


def server_ssl_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side TLS context (TLS 1.2 or later) presenting `cert` with `key`."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    return context


def client_ssl_context(cert: Path) -> ssl.SSLContext:
    """A client-side TLS context that trusts exactly `cert` (for aiohttp or raw sockets)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cert))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _atomic_write(path: Path, data: bytes, *, mode: int) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def _is_usable(cert_path: Path, key_path: Path) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return False
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc - _RENEW_MARGIN:
        return False
    own_public = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    cert_public = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if own_public != cert_public:
        return False
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return set(_DNS_NAMES) <= set(san.get_values_for_type(x509.DNSName)) and set(
        _IP_ADDRESSES
    ) <= set(san.get_values_for_type(x509.IPAddress))


def _generate() -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed certificate for localhost / 127.0.0.1 (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sblocal development"),
            x509.NameAttribute(NameOID.COMMON_NAME, "localhost"),
        ]
    )
    now = dt.datetime.now(dt.UTC)
    public_key = key.public_key()
    # The certificate is its own trust anchor (clients load it as their CA file). It stays an
    # end-entity certificate (CA:FALSE) so trusting it cannot vouch for anything else; the key
    # identifiers keep strict verifiers (Python 3.13's VERIFY_X509_STRICT) satisfied.
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + _VALIDITY)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(dns) for dns in _DNS_NAMES]
                + [x509.IPAddress(ip) for ip in _IP_ADDRESSES]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert_pem, key_pem
