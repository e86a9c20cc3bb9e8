"""Signed provenance: a C2PA manifest (Content Credentials) in every image the server returns.

The last stage of a response (after any infotext is written, so the signature covers the final bytes): each image
gets a ``c2pa.created`` action with the IPTC digital source type ``trainedAlgorithmicMedia`` and an
``org.sdserve.generation`` assertion with what the server knows about how it was made (server/provenance_stage.py
gathers it), signed with the operator's key and certificate chain by the official ``c2pa-python``.

Modes (``[provenance] mode``): ``off``; ``sign`` (unsigned only when no usable credential is configured or signing
fails, and then said in the ``x-sdserve-provenance`` header, a warning and the metric, never silently); ``require``
(boot exits 13 without a usable credential; an image that fails to sign is a 500). The private key is held in
memory only as the signer needs it: never logged, never in /capabilities (which shows the certificate's subject,
issuer, expiry and SHA-256 fingerprint).

c2pa-python and cryptography are imported when a credential is loaded: a server with provenance off never
loads the C2PA library.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engines.errors import SdserveError
from server import headers
from server.metrics import Metrics
from server.settings import ProvenanceSettings
from server.watermark import MIN_PIXELS, PAYLOAD_BITS, SCHEME, SKIP_REASONS, Marked, mark_bytes, payload_for

log = logging.getLogger(__name__)

GENERATION_LABEL = "org.sdserve.generation"
"""The assertion holding what the server knows about how the image was made."""
DIGITAL_SOURCE_TYPE = "http://cv.iptc.org/newscodes/digitalsourcetype/trainedAlgorithmicMedia"
HEADER = headers.PROVENANCE
"""Response header: ``c2pa`` (every image signed), ``off``, or ``unsigned; reason=<reason>``."""
WATERMARK_HEADER = headers.WATERMARK
"""With [provenance] watermark on: each image's payload in hex, or ``skipped:<reason>``, comma-separated in order."""
UnsignedReason = Literal["off", "no_credential", "signing_failed"]
UNSIGNED_REASONS: tuple[UnsignedReason, ...] = ("off", "no_credential", "signing_failed")
MEDIA_TYPES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}
_ALGORITHMS = {"secp256r1": "es256", "secp384r1": "es384", "secp521r1": "es512"}
_PROBE_PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
              b"\x00\x00\x00\x0cIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\r\xefF\xb8\x00\x00\x00\x00IEND\xaeB`\x82")
"""A 1x1 PNG the boot check signs: a credential is usable when the C2PA library signs with it, not before."""


class CredentialError(SdserveError):
    """No usable signing key and certificate chain (exit code 13, PROVENANCE_KEY_INVALID, in require mode)."""


class SigningError(SdserveError):
    """An image could not be signed in require mode: a 500 for that request, never an unsigned image."""


def media_type(data: bytes) -> str | None:
    """image/png, image/jpeg or image/webp from the file's magic bytes; None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for magic, kind in MEDIA_TYPES.items() if data.startswith(magic)), None)


@dataclass(frozen=True)
class Credential:
    """The operator's signing certificate chain and key, checked. ``public()`` is all that is ever shown."""

    chain_pem: bytes
    key_pem: bytes = field(repr=False)
    algorithm: str
    subject: str
    issuer: str
    fingerprint_sha256: str
    not_after: datetime.datetime

    def public(self) -> dict[str, str]:
        """What /capabilities shows: never the key, nor the chain's bytes."""
        return {"subject": self.subject, "issuer": self.issuer, "sha256_fingerprint": self.fingerprint_sha256,
                "algorithm": self.algorithm, "not_after": self.not_after.isoformat()}


def _pem(settings_path: str, kind: str) -> bytes:
    """PEM bytes from the profile's file, else the ``SDSERVE_PROVENANCE_<KIND>_FILE`` file, else the
    ``SDSERVE_PROVENANCE_<KIND>`` text; CredentialError names the source, never the contents."""
    path = settings_path or os.environ.get(f"SDSERVE_PROVENANCE_{kind}_FILE", "")
    if path:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise CredentialError(f"provenance {kind.lower()} file {path}: {exc.strerror or exc}") from None
    text = os.environ.get(f"SDSERVE_PROVENANCE_{kind}", "")
    if not text:
        raise CredentialError(f"no provenance {kind.lower()}: set [provenance] {kind.lower()}_file, "
                              f"SDSERVE_PROVENANCE_{kind}_FILE or SDSERVE_PROVENANCE_{kind}")
    return text.encode()


def load_credential(settings: ProvenanceSettings, now: datetime.datetime | None = None) -> Credential:
    """Read and check the key and chain: the key is the leaf certificate's, the leaf is not self-signed, is valid
    now and allows digital signatures; then one probe image is signed with them. Raises CredentialError saying
    what to fix (never quoting the key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    chain_pem, key_pem = _pem(settings.chain_file, "CHAIN"), _pem(settings.key_file, "KEY")
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
    except ValueError:
        raise CredentialError("the provenance chain is not PEM certificates (end-entity first)") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise CredentialError("the provenance key is not an unencrypted PEM private key") from None
    leaf = certs[0]
    _check_leaf(leaf, key, now or datetime.datetime.now(datetime.UTC))
    credential = Credential(chain_pem, key_pem, _algorithm(key), leaf.subject.rfc4514_string(),
                            leaf.issuer.rfc4514_string(),
                            leaf.fingerprint(hashes.SHA256()).hex(), leaf.not_valid_after_utc)
    try:
        sign_bytes(credential, _PROBE_PNG, "image/png", {"probe": True})
    except Exception as exc:  # the library's own words: its errors never carry the key
        raise CredentialError(f"the C2PA library cannot sign with this key and chain: {exc}") from None
    return credential


def _check_leaf(leaf: Any, key: Any, now: datetime.datetime) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if (leaf.public_key().public_bytes(serialization.Encoding.DER, spki)
            != key.public_key().public_bytes(serialization.Encoding.DER, spki)):
        raise CredentialError("the provenance key is not the key of the chain's first (end-entity) certificate")
    if leaf.issuer == leaf.subject:
        raise CredentialError("the provenance certificate is self-signed: C2PA needs one issued by a CA "
                              "(end-entity first in the chain, then the intermediates)")
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise CredentialError(f"the provenance certificate is not valid now (valid {leaf.not_valid_before_utc:%Y-%m-%d}"
                              f" to {leaf.not_valid_after_utc:%Y-%m-%d})")
    try:
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return
    if not usage.digital_signature:
        raise CredentialError("the provenance certificate's KeyUsage lacks digitalSignature")


def _algorithm(key: Any) -> str:
    """The C2PA signing algorithm of a private key: ES256/384/512 by curve, Ed25519, or PS256 for RSA."""
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    if isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name in _ALGORITHMS:
        return _ALGORITHMS[key.curve.name]
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return "ed25519"
    if isinstance(key, rsa.RSAPrivateKey):
        return "ps256"
    raise CredentialError("the provenance key must be EC (P-256, P-384, P-521), Ed25519 or RSA")


def manifest_definition(generation: dict[str, Any], version: str) -> dict[str, Any]:
    """The C2PA manifest: created by a trained model (IPTC trainedAlgorithmicMedia), with sdserve's facts. An edit
    (``generation["ingredients"]``, server/provenance_stage.py ingredient) records each input image as a C2PA
    ingredient (ingredient.v3: its title, format, relationship and ``instance_id`` ``sha256:<hex>`` of the bytes
    as sent): the actions are then ``c2pa.opened`` of the ``parentOf`` ingredient (the image edited), ``c2pa.edited``
    by the model and ``c2pa.placed`` of the ``componentOf`` ones (an instruction edit's other reference images);
    ``inputTo`` ingredients (the mask, a ControlNet's control image) are recorded without an action; an image
    with only those (a txt2img under ControlNet) is created, not edited (C2PA: the first action is created or
    opened)."""
    agent = {"name": "sdserve", "version": version}
    inputs: list[dict[str, Any]] = generation.get("ingredients") or []
    edited = any(item["relationship"] == "parentOf" for item in inputs)
    labels = [f"ingredient{i}" for i in range(len(inputs))]
    if not edited:
        actions = [{"action": "c2pa.created", "digitalSourceType": DIGITAL_SOURCE_TYPE, "softwareAgent": agent}]
    else:
        by: dict[str, list[str]] = {}
        for label, item in zip(labels, inputs, strict=True):
            by.setdefault(item["relationship"], []).append(label)
        actions = [*([{"action": "c2pa.opened", "parameters": {"ingredientIds": by["parentOf"]}}]
                     if "parentOf" in by else []),
                   {"action": "c2pa.edited", "digitalSourceType": DIGITAL_SOURCE_TYPE, "softwareAgent": agent},
                   *([{"action": "c2pa.placed", "parameters": {"ingredientIds": by["componentOf"]}}]
                     if "componentOf" in by else [])]
    definition: dict[str, Any] = {
        "claim_generator_info": [agent], "title": "edited image" if edited else "generated image",
        "assertions": [{"label": "c2pa.actions.v2", "data": {"actions": actions}},
                       {"label": GENERATION_LABEL, "data": generation}]}
    if inputs:  # described, not parsed: the upload's bytes never reach the C2PA library's readers
        definition["ingredients"] = [{"title": item["title"], "format": item["format"],
                                      "relationship": item["relationship"], "instance_id": f"sha256:{item['sha256']}",
                                      "label": label} for label, item in zip(labels, inputs, strict=True)]
    return definition


def sign_bytes(credential: Credential, data: bytes, kind: str, generation: dict[str, Any],
               version: str = "") -> bytes:
    """``data`` with a signed C2PA manifest embedded (no thumbnail: the image is its own). A signer per call:
    the library's objects are not shared between threads."""
    import c2pa

    context = c2pa.Context(c2pa.Settings.from_dict({"builder": {"thumbnail": {"enabled": False}}}))
    info = c2pa.C2paSignerInfo(credential.algorithm.encode(), credential.chain_pem, credential.key_pem, None)
    with c2pa.Signer.from_info(info) as signer, \
            c2pa.Builder(json.dumps(manifest_definition(generation, version)), context) as builder:
        out = io.BytesIO()
        builder.sign(signer, kind, io.BytesIO(data), out)
    return out.getvalue()


@dataclass(frozen=True)
class Stamped:
    """One response's images after the provenance stage, and what its header says."""

    images: list[bytes]
    status: str
    """``c2pa``, ``off`` or ``unsigned; reason=<reason>`` (the x-sdserve-provenance header)."""
    seconds: float = 0.0
    warning: str = ""


class Provenance:
    """The signing stage of one server: its mode, its credential (when usable) and its metrics."""

    def __init__(self, settings: ProvenanceSettings, credential: Credential | None, problem: str = "",
                 metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.credential = credential
        self.problem = problem
        """Why there is no credential (sign mode serves unsigned images and says so)."""
        self.metrics = metrics or Metrics()
        self.metrics.provenance_expiry.set(credential.not_after.timestamp() if credential else float("nan"))
        self.metrics.provenance_images.labels("signed", "")
        for reason in UNSIGNED_REASONS:
            self.metrics.provenance_images.labels("unsigned", reason)
        if settings.watermark:
            self.metrics.watermark_images.labels("marked", "")
            for skipped in SKIP_REASONS:
                self.metrics.watermark_images.labels("skipped", skipped)

    @classmethod
    def create(cls, settings: ProvenanceSettings, metrics: Metrics | None = None) -> Provenance:
        """The profile's provenance stage. require without a usable credential raises CredentialError (the
        process exits 13 before the port opens); sign without one logs why and serves images marked unsigned."""
        if settings.mode == "off":
            return cls(settings, None, metrics=metrics)
        try:
            credential = load_credential(settings)
        except CredentialError as exc:
            if settings.mode == "require":
                raise
            log.error("provenance mode sign without a usable credential: images are served UNSIGNED "
                      "(x-sdserve-provenance: unsigned; reason=no_credential): %s", exc)
            return cls(settings, None, str(exc), metrics)
        log.info("provenance: signing every image as %s (sha256 %s, expires %s)", credential.subject,
                 credential.fingerprint_sha256, credential.not_after.date())
        return cls(settings, credential, metrics=metrics)

    @property
    def mode(self) -> str:
        return self.settings.mode

    def snapshot(self) -> dict[str, Any]:
        """The /capabilities block: mode, whether images are signed, the certificate's public facts."""
        return {"mode": self.mode, "signing": self.credential is not None, "manifest": "c2pa",
                "assertion": GENERATION_LABEL, "include_prompt": self.settings.include_prompt,
                "certificate": self.credential.public() if self.credential else None,
                "watermark": {"scheme": SCHEME, "payload_bits": PAYLOAD_BITS, "min_pixels": MIN_PIXELS}
                if self.settings.watermark else None,
                **({"problem": self.problem} if self.problem else {})}

    def mark(self, images: list[bytes], request_id: str) -> list[Marked]:
        """Each image watermarked with its payload, ``payload_for(request_id, position in the response)``
        (blocking: call it off the event loop). An image that cannot carry a mark comes back unchanged with the
        reason; each payload is logged with its request, so the log maps a mark back without the manifest."""
        marks = [mark_bytes(image, payload_for(request_id, i)) for i, image in enumerate(images)]
        for i, mark in enumerate(marks):
            self.metrics.watermark_images.labels("marked" if mark.payload else "skipped", mark.skipped).inc()
            if mark.payload is not None:
                log.info("watermark %s: request %s image %d", mark.payload.hex(), request_id, i)
            else:  # too_small is every image of a small-size profile: the header, manifest and metric say it
                (log.debug if mark.skipped == "too_small" else log.warning)(
                    "watermark skipped (%s): request %s image %d", mark.skipped, request_id, i)
        return marks

    def stamp(self, images: list[bytes], facts: list[dict[str, Any]], version: str) -> Stamped:
        """Sign each image with its facts (blocking: call it off the event loop). In require mode a failure
        raises SigningError; in sign mode the images come back unsigned and the status says why."""
        if self.mode == "off":
            self.metrics.provenance_images.labels("unsigned", "off").inc(len(images))
            return Stamped(images, "off")
        if self.credential is None:
            return self._unsigned(images, "no_credential", "no usable signing credential (see the server log)")
        start = time.perf_counter()
        try:
            timed = [self._sign_one(image, fact, version) for image, fact in zip(images, facts, strict=True)]
        except Exception as exc:
            log.error("provenance: signing failed (%s): %s", type(exc).__name__, exc)
            if self.mode == "require":
                raise SigningError("an image could not be signed ([provenance] mode require)") from exc
            return self._unsigned(images, "signing_failed", "signing failed (see the server log)")
        for image, (signed, seconds) in zip(images, timed, strict=True):  # counted once every image is signed
            self.metrics.provenance_seconds.observe(seconds)
            self.metrics.provenance_bytes.observe(len(signed) - len(image))
        self.metrics.provenance_images.labels("signed", "").inc(len(timed))
        return Stamped([signed for signed, _ in timed], "c2pa", time.perf_counter() - start)

    def _sign_one(self, image: bytes, facts: dict[str, Any], version: str) -> tuple[bytes, float]:
        assert self.credential is not None
        kind = media_type(image)
        if kind is None:
            raise SigningError("not a PNG, JPEG or WebP image")
        start = time.perf_counter()
        return sign_bytes(self.credential, image, kind, facts, version), time.perf_counter() - start

    def _unsigned(self, images: list[bytes], reason: UnsignedReason, why: str) -> Stamped:
        self.metrics.provenance_images.labels("unsigned", reason).inc(len(images))
        return Stamped(images, f"unsigned; reason={reason}", warning=f"images not signed: {why}")


def digest_of(path: Path) -> str | None:
    """sha256 of a file (a manifest), None when it is absent."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
