"""A throwaway signing credential for provenance tests and dev: a CA and an end-entity certificate made now with
``cryptography`` (no private key is ever committed). The end-entity certificate has what C2PA asks of a signer:
issued by a CA (not self-signed), KeyUsage digitalSignature, an EKU (emailProtection), SubjectKeyIdentifier and
AuthorityKeyIdentifier."""

from __future__ import annotations

import datetime
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PEM = serialization.Encoding.PEM


@dataclass(frozen=True)
class SigningCredential:
    ca_pem: bytes
    chain_pem: bytes
    """End-entity certificate, then the CA."""
    key_pem: bytes
    leaf: x509.Certificate

    def write(self, folder: Path) -> tuple[Path, Path, Path]:
        """(key, chain, ca) files in ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = folder / "signer.key", folder / "chain.pem", folder / "ca.pem"
        for path, data in zip(paths, (self.key_pem, self.chain_pem, self.ca_pem), strict=True):
            path.write_bytes(data)
        paths[0].chmod(0o600)
        return paths

    def require_env(self, folder: Path) -> dict[str, str]:
        """The environment of a server that signs every image with this credential ([provenance] mode require),
        its key and chain written into ``folder``."""
        key, chain, _ = self.write(folder)
        return {"SDSERVE_PROVENANCE_MODE": "require", "SDSERVE_PROVENANCE_KEY_FILE": str(key),
                "SDSERVE_PROVENANCE_CHAIN_FILE": str(chain)}


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sdserve test")])


def _certificate(subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey,
                 signer: ec.EllipticCurvePrivateKey, *, ca: bool, days: float) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    start, end = (now + datetime.timedelta(days=days - 2), now + datetime.timedelta(days=days)) if days < 0 else \
        (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public)
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False))
    if ca:
        return builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                     critical=True)
    return (builder.add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False),
                                  critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.EMAIL_PROTECTION]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()), critical=False))


def make_credential(days: float = 2.0, self_signed: bool = False,
                    name: str = "sdserve test signer") -> SigningCredential:
    """A CA and an end-entity certificate valid for ``days`` (negative: expired that many days ago), or with
    ``self_signed`` a lone self-signed end-entity certificate (which C2PA refuses)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(_name("sdserve test CA"), _name("sdserve test CA"), ca_key.public_key(), ca_key, ca=True,
                      days=30).sign(ca_key, hashes.SHA256())
    key = ec.generate_private_key(ec.SECP256R1())
    issuer, signer = (_name(name), key) if self_signed else (ca.subject, ca_key)
    leaf = _certificate(_name(name), issuer, key.public_key(), signer, ca=False, days=days).sign(signer,
                                                                                                 hashes.SHA256())
    key_pem = key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    chain = leaf.public_bytes(PEM) + (b"" if self_signed else ca.public_bytes(PEM))
    return SigningCredential(ca.public_bytes(PEM), chain, key_pem, leaf)


def change_one_pixel(png: bytes) -> bytes:
    """The same PNG (every chunk kept, the C2PA manifest included) with its first pixel's red channel changed:
    the IDAT data decompressed, one byte of the first scanline flipped, compressed again, CRCs recomputed."""
    chunks, pos = [], 8
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos:pos + 4])
        chunks.append((png[pos + 4:pos + 8], png[pos + 8:pos + 8 + length]))
        pos += 12 + length
    raw = bytearray(zlib.decompress(b"".join(data for kind, data in chunks if kind == b"IDAT")))
    raw[1] ^= 0x01  # byte 0 is the scanline's filter type; byte 1 is the first pixel's red
    out, written = [png[:8]], False
    for kind, data in chunks:
        if kind == b"IDAT":
            if written:
                continue
            data, written = zlib.compress(bytes(raw)), True
        out.append(struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data)))
    return b"".join(out)
