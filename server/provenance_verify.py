"""Reading and validating an image's C2PA manifest (``sdserve verify``): what it says, whether its signature and
hashes hold, whether its signer chains to the operator's trust list, and what no longer matches; and the invisible
watermark its pixels carry (server/watermark.py), which outlives a stripped manifest."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from server import watermark
from server.provenance import GENERATION_LABEL, media_type

Verdict = Literal["trusted", "untrusted", "invalid", "watermark_only", "no_manifest"]
EXPLAINED = {
    "assertion.dataHash.mismatch": "the image's bytes changed after signing (pixels edited or re-encoded)",
    "assertion.boxesHash.mismatch": "the image's bytes changed after signing",
    "assertion.hashedURI.mismatch": "an assertion of the manifest changed after signing",
    "claimSignature.mismatch": "the signature does not match the manifest (the manifest was edited)",
    "claimSignature.missing": "the manifest's signature is missing or unreadable",
    "signingCredential.untrusted": "the signer's certificate does not chain to the trust list",
    "signingCredential.expired": "the signer's certificate had expired when it signed",
    "signingCredential.revoked": "the signer's certificate is revoked",
    "signingCredential.invalid": "the signer's certificate is invalid for C2PA signing",
}
"""C2PA validation codes, in words (the specification's codes are printed too)."""


@dataclass
class Verification:
    """What one image's manifest says and how it validated."""

    verdict: Verdict
    problems: list[str] = field(default_factory=list)
    """What does not hold, each "code: meaning"; empty when trusted."""
    media_type: str | None = None
    signer: dict[str, Any] = field(default_factory=dict)
    """The signature's facts as the manifest states them (issuer, common name, algorithm, time)."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    generation: dict[str, Any] | None = None
    """The org.sdserve.generation assertion, when present."""
    generator: list[dict[str, Any]] = field(default_factory=list)
    watermark: dict[str, Any] | None = None
    """What the pixels' watermark says (``read_watermark``); None when the image could not be decoded."""
    ingredients: list[dict[str, Any]] = field(default_factory=list)
    """An edit's input images as the manifest's C2PA ingredients: title, format, relationship (parentOf,
    componentOf, inputTo) and the SHA-256 of the bytes sent (from the ingredient's ``sha256:`` instance id)."""

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "problems": self.problems, "media_type": self.media_type,
                "signer": self.signer, "claim_generator": self.generator, "actions": self.actions,
                "ingredients": self.ingredients, "generation": self.generation, "watermark": self.watermark}


def _explain(code: str, explanation: str = "") -> str:
    return f"{code}: {EXPLAINED.get(code) or explanation or 'see the C2PA specification'}"


def read_store(data: bytes, kind: str, trust_pem: str | None) -> dict[str, Any]:
    """The manifest store as the C2PA library reports it, validated against ``trust_pem`` (PEM CA certificates)
    when given; without one, a valid signature is reported untrusted."""
    import c2pa

    settings: dict[str, Any] = {"verify": {"verify_trust": trust_pem is not None}}
    if trust_pem is not None:
        settings["trust"] = {"trust_anchors": trust_pem}
    context = c2pa.Context(c2pa.Settings.from_dict(settings))
    with c2pa.Reader(kind, io.BytesIO(data), context=context) as reader:
        store: dict[str, Any] = json.loads(reader.json())
    return store


def verify_bytes(data: bytes, trust_pem: str | None = None) -> Verification:
    """Validate one image: ``trusted`` (signature and hashes hold, the signer chains to ``trust_pem``),
    ``untrusted`` (they hold, the signer is not in the trust list, or none was given), ``invalid`` (something
    changed after signing: each problem named), ``watermark_only`` (no manifest, but the pixels carry an sdserve
    watermark) or ``no_manifest`` (never signed, or stripped, and no watermark)."""
    result = _manifest(data, trust_pem)
    if result.media_type is not None:
        result.watermark = read_watermark(data, result.generation)
        if result.verdict == "no_manifest" and result.watermark and result.watermark.get("payload"):
            result.verdict = "watermark_only"
    return result


def _manifest(data: bytes, trust_pem: str | None) -> Verification:
    import c2pa

    kind = media_type(data)
    if kind is None:
        return Verification("no_manifest", ["not a PNG, JPEG or WebP image"])
    try:
        store = read_store(data, kind, trust_pem)
    except c2pa.C2paError as exc:
        text = str(exc)
        if "ManifestNotFound" in type(exc).__name__ or "no JUMBF" in text or "ManifestNotFound" in text:
            return Verification("no_manifest", ["no C2PA manifest: never signed, or stripped (re-encoded, "
                                                "metadata removed)"], kind)
        return Verification("invalid", [f"the manifest cannot be read: {text}"], kind)
    return _verdict(store, kind, trust_pem is not None)


def read_watermark(data: bytes, generation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The watermark of an encoded image: its payload (hex) when one reads with a valid check, else None, the
    share of blocks that agree, and, when the manifest records a payload, whether the pixels carry it (and how
    many of its 64 bits they do). None when the image cannot be decoded."""
    try:
        reading = watermark.read_bytes(data)
    except (OSError, ValueError):
        return None
    recorded = (generation or {}).get("watermark") or {}
    claimed = recorded.get("payload") if isinstance(recorded, dict) else None
    if reading is None:
        return {"scheme": watermark.SCHEME, "payload": None, "skipped": "too_small", "manifest_payload": claimed}
    out: dict[str, Any] = {"scheme": watermark.SCHEME, "payload": reading.payload.hex() if reading.payload else None,
                           "agreement": round(reading.agreement, 3), "manifest_payload": claimed}
    if isinstance(claimed, str):
        try:
            expected = bytes.fromhex(claimed)
        except ValueError:
            expected = b""
        out["matches_manifest"] = reading.payload == expected
        if len(expected) == len(reading.bits):
            out["bits_matching_manifest"] = reading.matches(expected)
    return out


def _verdict(store: dict[str, Any], kind: str, trust_given: bool) -> Verification:
    active = store.get("manifests", {}).get(store.get("active_manifest", ""), {})
    assertions = {a.get("label"): a.get("data") for a in active.get("assertions", [])}
    actions = (assertions.get("c2pa.actions.v2") or assertions.get("c2pa.actions") or {}).get("actions", [])
    result = Verification("invalid", [], kind, active.get("signature_info", {}), actions,
                          assertions.get(GENERATION_LABEL), active.get("claim_generator_info", []),
                          ingredients=[_ingredient(i) for i in active.get("ingredients", [])])
    statuses = store.get("validation_status") or []
    state = store.get("validation_state", "")
    untrusted = [s for s in statuses if s.get("code") == "signingCredential.untrusted"]
    failures = [s for s in statuses if s not in untrusted]
    if state == "Trusted" and not statuses:
        result.verdict = "trusted"
    elif state in ("Valid", "Trusted") and not failures:
        result.verdict = "untrusted"
        result.problems = [_explain("signingCredential.untrusted") if trust_given else
                           "signingCredential.untrusted: no trust list given (--trust CA.pem)"]
    else:
        result.problems = [_explain(str(s.get("code")), str(s.get("explanation", ""))) for s in failures] or \
            [f"validation state {state or 'unknown'}"]
    return result


def _ingredient(item: dict[str, Any]) -> dict[str, Any]:
    """One ingredient as verify shows it (the hash read back from sdserve's ``sha256:<hex>`` instance id)."""
    instance = str(item.get("instance_id", ""))
    return {"title": item.get("title"), "format": item.get("format"), "relationship": item.get("relationship"),
            "sha256": instance.removeprefix("sha256:") if instance.startswith("sha256:") else None}
