"""Certificates, static tokens and kubeconfigs for the local cluster, made with the openssl CLI.

Layout under `<state>/pki`: ca.{crt,key}, apiserver.{crt,key}, sa.{key,pub}, tokens.csv, and one
`<identity>.token` per token identity. Kubeconfigs go to `<state>/<name>.kubeconfig`.
"""

from __future__ import annotations

import csv
import io
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

CLUSTER_NAME = "batchtune-local"


@dataclass(frozen=True)
class TokenIdentity:
    """A user the API server knows from its static token file."""

    user: str
    groups: tuple[str, ...] = ()


ADMIN = TokenIdentity("batchtune-admin", ("system:masters",))
# No groups beyond system:authenticated, so every permission must come from RBAC.
OPERATOR = TokenIdentity("batchtune-operator")
CONTROLLER_MANAGER = TokenIdentity("system:kube-controller-manager")
SCHEDULER = TokenIdentity("system:kube-scheduler")
PROMETHEUS = TokenIdentity("batchtune-prometheus")
TOKEN_IDENTITIES = (ADMIN, OPERATOR, CONTROLLER_MANAGER, SCHEDULER, PROMETHEUS)


def _openssl(openssl: Path, *args: str | Path) -> None:
    subprocess.run([str(openssl), *map(str, args)], check=True, capture_output=True)


def ensure_pki(pki: Path, openssl: Path) -> None:
    """Create the CA, the API server's serving cert, the service-account keypair and tokens, once."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _openssl(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
                 "-subj", "/CN=batchtune-local-ca", "-keyout", pki / "ca.key", "-out", pki / "ca.crt")
    if not (pki / "apiserver.crt").exists():
        ext = pki / "apiserver.ext"
        ext.write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
            "extendedKeyUsage=serverAuth\n"
        )
        _sign(openssl, pki, "apiserver", "/CN=kube-apiserver", ext)
    if not (pki / "sa.key").exists():
        _openssl(openssl, "genrsa", "-out", pki / "sa.key", "2048")
        _openssl(openssl, "rsa", "-in", pki / "sa.key", "-pubout", "-out", pki / "sa.pub")
    if not (pki / "tokens.csv").exists():
        _write_tokens(pki)


def _sign(openssl: Path, pki: Path, name: str, subject: str, ext: Path) -> None:
    _openssl(openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject,
             "-keyout", pki / f"{name}.key", "-out", pki / f"{name}.csr")
    _openssl(openssl, "x509", "-req", "-in", pki / f"{name}.csr", "-CA", pki / "ca.crt",
             "-CAkey", pki / "ca.key", "-CAcreateserial", "-days", "3650",
             "-out", pki / f"{name}.crt", "-extfile", ext)


def _write_tokens(pki: Path) -> None:
    out = io.StringIO()
    rows = csv.writer(out, lineterminator="\n")
    for identity in TOKEN_IDENTITIES:
        token = secrets.token_hex(24)
        (pki / f"{identity.user}.token").write_text(token)
        rows.writerow([token, identity.user, identity.user, *([",".join(identity.groups)] if identity.groups else [])])
    (pki / "tokens.csv").write_text(out.getvalue())


def token_of(pki: Path, identity: TokenIdentity) -> str:
    return (pki / f"{identity.user}.token").read_text().strip()


def write_kubeconfig(path: Path, server: str, ca: Path, user: str, *, token: str | None = None,
                     client_cert: Path | None = None, client_key: Path | None = None) -> Path:
    """Write a one-context kubeconfig for `user` at `server`, authenticating by token or client cert."""
    credentials: dict[str, str] = {}
    if token is not None:
        credentials["token"] = token
    if client_cert is not None and client_key is not None:
        credentials["client-certificate"] = str(client_cert)
        credentials["client-key"] = str(client_key)
    if not credentials:
        raise ValueError(f"kubeconfig for user={user!r} needs a token or a client certificate")
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CLUSTER_NAME, "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": f"{user}@{CLUSTER_NAME}", "context": {"cluster": CLUSTER_NAME, "user": user}}],
        "current-context": f"{user}@{CLUSTER_NAME}",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def issue_client_cert(pki: Path, openssl: Path, user: str, groups: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Sign a client certificate for `user` in `groups` with the cluster CA (the API server trusts it)."""
    name = "client-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
    subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
    ext = pki / f"{name}.ext"
    ext.write_text("extendedKeyUsage=clientAuth\n")
    _sign(openssl, pki, name, subject, ext)
    return pki / f"{name}.crt", pki / f"{name}.key"
