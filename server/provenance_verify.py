"""Reading and validating an image's C2PA manifest (``sdserve verify``): what it says, whether its signature and
hashes hold, whether its signer chains to the operator's trust list, and what no longer matches."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from server.provenance import GENERATION_LABEL, media_type

Verdict = Literal["trusted", "untrusted", "invalid", "no_manifest"]
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

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "problems": self.problems, "media_type": self.media_type,
                "signer": self.signer, "claim_generator": self.generator, "actions": self.actions,
                "generation": self.generation}


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
    changed after signing: each problem named) or ``no_manifest`` (never signed, or stripped)."""
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


def _verdict(store: dict[str, Any], kind: str, trust_given: bool) -> Verification:
    active = store.get("manifests", {}).get(store.get("active_manifest", ""), {})
    assertions = {a.get("label"): a.get("data") for a in active.get("assertions", [])}
    actions = (assertions.get("c2pa.actions.v2") or assertions.get("c2pa.actions") or {}).get("actions", [])
    result = Verification("invalid", [], kind, active.get("signature_info", {}), actions,
                          assertions.get(GENERATION_LABEL), active.get("claim_generator_info", []))
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
