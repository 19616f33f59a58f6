"""Mutual TLS between the controller and the workers: only holders of the run's certificate
can attach to a worker (and run code there) or talk to the controller.

Monarch 0.7.0's Python API refuses any `ca=` but "trust_all_connections", yet its transport
already does TLS: a `tls://HOST:PORT` address, with the CA, certificate and key named by the
HYPERACTOR_TLS_* variables of each process. Both ends then demand a certificate signed by
the CA, and each checks that the other's certificate names the address it dialled.

The run's CA reaches every node as two secrets (MONARCH_SKY_TLS_CA, MONARCH_SKY_TLS_CA_KEY,
made once by `monarch-sky tls-ca`); each node issues itself a certificate for its own
address and names (`monarch-sky tls-node`). Holding the CA key grants nothing a node
certificate does not: any certificate it signs is let in.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import os
from pathlib import Path

CA_ENV, CA_KEY_ENV = "MONARCH_SKY_TLS_CA", "MONARCH_SKY_TLS_CA_KEY"
HYPERACTOR_ENV = {"ca": "HYPERACTOR_TLS_CA", "cert": "HYPERACTOR_TLS_CERT", "key": "HYPERACTOR_TLS_KEY"}
# A run's certificates outlive any run: a recovery on day 40 of a long run must still connect.
CA_VALID = datetime.timedelta(days=3 * 365)
NODE_VALID = datetime.timedelta(days=365)


def scheme() -> str:
    """The Monarch transport of this process: tls once it has a certificate, else tcp."""
    return "tls" if all(os.environ.get(v) for v in HYPERACTOR_ENV.values()) else "tcp"


def _pem(cert, key) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject, issuer, public_key, valid: datetime.timedelta):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + valid)
    )


def new_ca(name: str = "monarch-sky run CA") -> tuple[str, str]:
    """A fresh CA certificate and key, PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(name), _name(name), key.public_key(), CA_VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return _pem(cert, key)


def issue(ca_pem: str, ca_key_pem: str, hosts: list[str]) -> tuple[str, str]:
    """A certificate for `hosts` (IPs and names this node is dialled by), signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    ca_key = serialization.load_pem_private_key(ca_key_pem.encode(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    names = [_san(h) for h in dict.fromkeys(hosts)]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        _builder(_name(hosts[0]), ca.subject, key.public_key(), min(NODE_VALID, _left(ca)))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _pem(cert, key)


def _left(ca) -> datetime.timedelta:
    """How long the CA stays valid: a node certificate cannot outlive it."""
    left = ca.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    if left <= datetime.timedelta(0):
        raise ValueError(f"the run CA expired on {ca.not_valid_after_utc:%Y-%m-%d}; make a new one with `monarch-sky tls-ca`")
    return left


def _san(host: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def as_secret(pem: str) -> str:
    """PEM as one line (base64), so it travels as a SkyPilot secret or an env var."""
    return base64.b64encode(pem.encode()).decode()


def exports(env: dict[str, str]) -> str:
    """`export NAME=VALUE` lines for a shell to eval."""
    import shlex

    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def ca_exports() -> str:
    """A new run CA as the shell exports the recipes' `--secret` flags read."""
    cert, key = new_ca()
    return exports({CA_ENV: as_secret(cert), CA_KEY_ENV: as_secret(key)})


def _from_secret(value: str) -> str:
    return value if value.lstrip().startswith("-----BEGIN") else base64.b64decode(value).decode()


def node_env(out_dir: str, hosts: list[str], environ=os.environ) -> dict[str, str]:
    """Issue this node's certificate from the run's CA (in `environ`, PEM or `as_secret`) into
    `out_dir` (mode 0600) and return the HYPERACTOR_TLS_* settings for TLS."""
    ca, ca_key = environ.get(CA_ENV, "").strip(), environ.get(CA_KEY_ENV, "").strip()
    if not (ca and ca_key):
        raise ValueError(f"{CA_ENV} and {CA_KEY_ENV} must both be set (make them with `monarch-sky tls-ca`)")
    try:
        ca_pem, ca_key_pem = _from_secret(ca), _from_secret(ca_key)
    except ValueError as e:
        raise ValueError(f"{CA_ENV}/{CA_KEY_ENV} are neither PEM nor `monarch-sky tls-ca` output: {e}") from None
    cert_pem, key_pem = issue(ca_pem, ca_key_pem, hosts)
    out = _private_dir(Path(out_dir))
    env = {}
    for what, text in {"ca": ca_pem, "cert": cert_pem, "key": key_pem}.items():
        path = out / f"{what}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)  # a file that existed keeps its mode through O_CREAT
            f.write(text)
        env[HYPERACTOR_ENV[what]] = str(path)
    return env


def _private_dir(out: Path) -> Path:
    """`out`, made if missing, refused unless it is this user's own directory; mode 0700."""
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = out.lstat()
    if out.is_symlink() or st.st_uid != os.getuid():
        raise ValueError(f"{out} is a link or belongs to another user: certificates are not written there")
    out.chmod(0o700)
    return out


if __name__ == "__main__":  # `python3 -m monarch_sky.hosts.tls`: the CA with only `cryptography` installed
    print(ca_exports())
