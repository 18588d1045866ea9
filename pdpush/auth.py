"""CurveZMQ authentication for the control plane: key files, the sender allowlist, ZAP.

``pdpush keygen NAME --dir DIR`` writes ``DIR/NAME.key`` (public certificate, share
it) and ``DIR/NAME.key_secret`` (mode 0600, keep it). A receiver with a secret
key runs as a CURVE server and admits only senders whose public keys are on
its allowlist; a sender needs its own key pair and the receiver's public key.
Imports zmq only.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from pdpush.errors import ConfigError


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes


def keygen(directory: Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """``directory/name.key`` and ``name.key_secret`` (0600 from the start). An existing pair is kept unless
    ``force``: its public key is on the peers' allowlists, and a new one would lock this daemon out of them."""
    directory.mkdir(parents=True, exist_ok=True)
    # (a link counts, a dangling one too: exists() follows it, and the secret was written through it)
    have = [f for f in (directory / f"{name}.key", directory / f"{name}.key_secret") if os.path.lexists(f)]
    if have and not force:
        raise ConfigError(f"{have[0]} exists: --force replaces the pair (then give its peers the new public key)")
    for f in have:  # made afresh: an existing file keeps its mode (0644, say) while the new secret is written to it,
        f.unlink()  # and a link there would be followed
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(sec, 0o600)
    os.chmod(pub, 0o644)  # (the public one is to share: the daemons' user reads it where root made it)
    return Path(pub), Path(sec)


def load_keypair(path: str) -> KeyPair:
    try:
        mode = os.stat(path).st_mode
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE secret key file {path}: {e}") from None
    if sec is None:
        raise ConfigError(f"{path} holds no secret key (use the .key_secret file from `pdpush keygen`)")
    if mode & 0o027:  # (group read stays allowed: a Kubernetes secret volume with fsGroup is 0440)
        raise ConfigError(f"CURVE secret key file {path} may be read or written by other users (mode "
                          f"{mode & 0o777:o}): chmod 600 it")
    return KeyPair(pub, sec)


def _certificate(path: Path) -> bytes:
    try:
        return zmq.auth.load_certificate(str(path))[0]
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read public key file {path}: {e}") from None


def load_public_keys(spec: str) -> list[bytes]:
    """A Z85 public key, a certificate file, or a directory of ``*.key`` certificates (at least one)."""
    p = Path(spec)
    if p.is_dir():
        keys = [_certificate(f) for f in sorted(p.glob("*.key"))]
        if not keys:  # an allowlist that admits no one: every peer refused, silently
            raise ConfigError(f"no public key (*.key) in directory {p}")
        return keys
    if p.is_file():
        return [_certificate(p)]
    if len(spec) == 40:
        try:
            if len(zmq.utils.z85.decode(spec)) == 32:
                return [spec.encode()]
        except (ValueError, KeyError, IndexError, struct.error):
            pass
    raise ConfigError(f"{spec!r} is neither a 40-character Z85 public key, a key file nor a directory")


class _Allowlist:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class Authenticator:
    """A ZAP handler (in its own thread, as pyzmq runs it) admitting allowlisted CURVE keys only."""

    def __init__(self, allowed: list[bytes]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._auth = ThreadAuthenticator(zmq.Context.instance())
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_Allowlist(set(allowed)))

    def stop(self) -> None:
        self._auth.stop()


def make_server(sock: zmq.Socket, keys: KeyPair) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
