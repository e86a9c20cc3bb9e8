"""Provenance: the signing credential's checks, C2PA signing and verification of PNG/JPEG/WebP with a CA made in
the test, the modes (off / sign / require) and `sdserve verify`'s report and exit codes. Real c2pa-python, no fakes."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from PIL import Image

from engines.errors import ConfigError
from server.cli.main import main
from server.exitcodes import ExitCode, exit_code_for
from server.metrics import Metrics
from server.provenance import (
    DIGITAL_SOURCE_TYPE,
    CredentialError,
    Provenance,
    SigningError,
    load_credential,
    sign_bytes,
)
from server.provenance_verify import verify_bytes
from server.settings import ProvenanceSettings, load_settings
from tests.provenance_ca import SigningCredential, change_one_pixel, make_credential

FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
FACTS = {"model": {"id": "tiny"}, "seed": 1234, "sampler": "euler", "request_id": "req-1"}


@pytest.fixture(scope="module")
def credential() -> SigningCredential:
    return make_credential()


@pytest.fixture
def files(tmp_path: Path, credential: SigningCredential) -> tuple[Path, Path, Path]:
    return credential.write(tmp_path / "cred")


def _settings(files: tuple[Path, Path, Path], mode: str = "require", **extra: object) -> ProvenanceSettings:
    return ProvenanceSettings(mode=mode, key_file=str(files[0]), chain_file=str(files[1]), **extra)  # type: ignore[arg-type]


def _image(fmt: str, seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=FORMATS[fmt], **({} if fmt == "png" else {"quality": 90}))
    return buffer.getvalue()


def test_credential_is_checked_and_only_its_public_facts_are_shown(files: tuple[Path, Path, Path],
                                                                  credential: SigningCredential) -> None:
    loaded = load_credential(_settings(files))
    der = credential.leaf.public_bytes(serialization.Encoding.DER)
    assert loaded.fingerprint_sha256 == hashlib.sha256(der).hexdigest()
    assert "CN=sdserve test signer" in loaded.subject and "CN=sdserve test CA" in loaded.issuer
    assert loaded.algorithm == "es256"
    key_body = credential.key_pem.decode().splitlines()[1]
    provenance = Provenance(_settings(files), loaded)
    for shown in (repr(loaded), json.dumps(loaded.public()), json.dumps(provenance.snapshot())):
        assert key_body not in shown and "PRIVATE KEY" not in shown
    assert provenance.snapshot()["certificate"]["sha256_fingerprint"] == loaded.fingerprint_sha256


@pytest.mark.parametrize(("make", "fragment"), [
    (lambda: make_credential(self_signed=True), "self-signed"),
    (lambda: make_credential(days=-1), "not valid now"),
])
def test_unusable_certificates_are_refused_saying_why(tmp_path: Path, make: object, fragment: str) -> None:
    bad: SigningCredential = make()  # type: ignore[operator]
    with pytest.raises(CredentialError, match=fragment):
        load_credential(_settings(bad.write(tmp_path)))


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path, credential: SigningCredential) -> None:
    key, chain, _ = credential.write(tmp_path / "a")
    other_key, _, _ = make_credential().write(tmp_path / "b")
    with pytest.raises(CredentialError, match="not the key of the chain") as caught:
        load_credential(ProvenanceSettings(mode="require", key_file=str(other_key), chain_file=str(chain)))
    assert "PRIVATE KEY" not in str(caught.value)


def test_require_without_a_key_refuses_to_boot_with_its_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KEY", "CHAIN", "KEY_FILE", "CHAIN_FILE"):
        monkeypatch.delenv(f"SDSERVE_PROVENANCE_{name}", raising=False)
    with pytest.raises(CredentialError, match="SDSERVE_PROVENANCE_CHAIN") as caught:
        Provenance.create(ProvenanceSettings(mode="require"))
    assert exit_code_for(caught.value) == ExitCode.PROVENANCE_KEY_INVALID == 13


def test_the_key_and_chain_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                         credential: SigningCredential) -> None:
    monkeypatch.setenv("SDSERVE_PROVENANCE_KEY", credential.key_pem.decode())
    monkeypatch.setenv("SDSERVE_PROVENANCE_CHAIN", credential.chain_pem.decode())
    provenance = Provenance.create(ProvenanceSettings(mode="require"))
    assert provenance.credential is not None and provenance.snapshot()["signing"] is True


def test_sign_mode_without_a_key_serves_images_marked_unsigned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDSERVE_PROVENANCE_KEY", raising=False)
    monkeypatch.delenv("SDSERVE_PROVENANCE_CHAIN", raising=False)
    metrics = Metrics()
    provenance = Provenance.create(ProvenanceSettings(mode="sign", key_file="missing.key",
                                                      chain_file="missing.pem"), metrics)
    image = _image("png")
    stamped = provenance.stamp([image], [FACTS], "test")
    assert stamped.images == [image] and stamped.status == "unsigned; reason=no_credential"
    assert "not signed" in stamped.warning
    assert metrics.registry.get_sample_value("sdserve_provenance_images_total",
                                             {"outcome": "unsigned", "reason": "no_credential"}) == 1


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_signed_images_verify_with_the_trust_list_and_are_untrusted_without(credential: SigningCredential,
                                                                            files: tuple[Path, Path, Path],
                                                                            fmt: str) -> None:
    source = _image(fmt)
    metrics = Metrics()
    stamped = Provenance(_settings(files), load_credential(_settings(files)), metrics=metrics).stamp(
        [source], [FACTS], "9.9.9")
    signed = stamped.images[0]
    assert stamped.status == "c2pa" and len(signed) > len(source)
    trusted = verify_bytes(signed, credential.ca_pem.decode())
    assert trusted.verdict == "trusted" and trusted.problems == []
    assert trusted.generation == FACTS
    assert trusted.actions[0]["action"] == "c2pa.created"
    assert trusted.actions[0]["digitalSourceType"] == DIGITAL_SOURCE_TYPE
    assert trusted.generator[0]["version"] == "9.9.9"
    untrusted = verify_bytes(signed)
    assert untrusted.verdict == "untrusted" and "signingCredential.untrusted" in untrusted.problems[0]
    assert verify_bytes(signed, make_credential().ca_pem.decode()).verdict == "untrusted"  # another CA
    sample = metrics.registry.get_sample_value
    assert sample("sdserve_provenance_images_total", {"outcome": "signed", "reason": ""}) == 1
    assert sample("sdserve_provenance_added_bytes_sum") == len(signed) - len(source)


def test_one_changed_pixel_fails_verification_naming_why(credential: SigningCredential,
                                                         files: tuple[Path, Path, Path]) -> None:
    signed = sign_bytes(load_credential(_settings(files)), _image("png"), "image/png", FACTS)
    tampered = change_one_pixel(signed)
    before, after = (np.asarray(Image.open(io.BytesIO(b))) for b in (signed, tampered))
    assert int((before != after).any(axis=2).sum()) == 1  # exactly one pixel differs
    result = verify_bytes(tampered, credential.ca_pem.decode())
    assert result.verdict == "invalid"
    assert any(p.startswith("assertion.dataHash.mismatch") and "changed after signing" in p for p in result.problems)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_stripped_manifest_is_reported(credential: SigningCredential, files: tuple[Path, Path, Path],
                                         fmt: str) -> None:
    signed = sign_bytes(load_credential(_settings(files)), _image(fmt), f"image/{fmt}", FACTS)
    buffer = io.BytesIO()
    Image.open(io.BytesIO(signed)).save(buffer, format=FORMATS[fmt])  # what a re-encoding pipeline does
    result = verify_bytes(buffer.getvalue(), credential.ca_pem.decode())
    assert result.verdict == "no_manifest" and "stripped" in result.problems[0]


def test_a_signing_failure_is_an_error_in_require_and_marked_in_sign(files: tuple[Path, Path, Path]) -> None:
    credential = load_credential(_settings(files))
    not_an_image = b"GIF89a" + bytes(64)
    with pytest.raises(SigningError):
        Provenance(_settings(files, "require"), credential).stamp([not_an_image], [FACTS], "")
    metrics = Metrics()
    stamped = Provenance(_settings(files, "sign"), credential, metrics=metrics).stamp(
        [_image("png"), not_an_image], [FACTS, FACTS], "")
    assert stamped.status == "unsigned; reason=signing_failed"
    sample = metrics.registry.get_sample_value
    assert sample("sdserve_provenance_images_total", {"outcome": "unsigned", "reason": "signing_failed"}) == 2
    assert sample("sdserve_provenance_images_total", {"outcome": "signed", "reason": ""}) == 0
    assert all(verify_bytes(image).verdict == "no_manifest" for image in stamped.images)


def test_the_environment_may_raise_the_mode_never_lower_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert load_settings("dev").provenance.mode == "off"
    monkeypatch.setenv("SDSERVE_PROVENANCE_MODE", "require")
    monkeypatch.setenv("SDSERVE_PROVENANCE_KEY_FILE", "signer.key")
    raised = load_settings("dev").provenance
    assert raised.mode == "require" and raised.key_file == "signer.key"
    profile = tmp_path / "p.toml"
    profile.write_text('profile = "dev"\n[runtime]\nproviders = ["CPUExecutionProvider"]\nallow_cpu = true\n'
                       '[provenance]\nmode = "sign"\n')
    monkeypatch.setenv("SDSERVE_PROVENANCE_MODE", "off")
    with pytest.raises(ConfigError, match="never lower it"):
        load_settings("dev", profile)


def test_verify_cli_reports_and_exits_by_the_worst_image(tmp_path: Path, credential: SigningCredential,
                                                         files: tuple[Path, Path, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    signed = sign_bytes(load_credential(_settings(files)), _image("png"), "image/png", FACTS)
    good, bad, bare = tmp_path / "good.png", tmp_path / "bad.png", tmp_path / "bare.png"
    good.write_bytes(signed)
    bad.write_bytes(change_one_pixel(signed))
    bare.write_bytes(_image("png"))
    ca = files[2]
    assert main(["verify", str(good), "--trust", str(ca)]) == 0
    out = capsys.readouterr().out
    assert "TRUSTED" in out and "c2pa.created" in out and '"seed": 1234' in out and "sdserve test signer" in out
    assert main(["verify", str(good)]) == ExitCode.VERIFY_UNTRUSTED == 40
    assert main(["verify", str(good), str(bare), "--trust", str(ca)]) == ExitCode.VERIFY_NO_MANIFEST == 42
    assert main(["verify", str(good), str(bad), str(bare), "--trust", str(ca)]) == ExitCode.VERIFY_INVALID == 41
    capsys.readouterr()
    assert main(["verify", "--json", str(bad), "--trust", str(ca)]) == 41
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "invalid" and report["generation"]["request_id"] == "req-1"
    assert main(["verify", str(tmp_path / "nope.png")]) == ExitCode.USAGE
    assert main(["verify", str(good), "--trust", str(files[0].parent / "signer.key")]) == ExitCode.USAGE


def test_prompts_enter_the_manifest_only_when_the_profile_opts_in() -> None:
    from engines.types.request import Batch, BatchResult, EditImage, GeneratedImage, ImageSpec
    from server.provenance_stage import image_facts
    from server.service import Generated

    edit = EditImage(np.zeros((64, 48, 3), np.uint8))
    batch = Batch((ImageSpec("a red fox", "blurry", seed=5, guidance_scale=6.0, edit=edit),), width=48, height=64,
                  steps=8, scheduler="dpmpp_2m_karras", strength=0.4)
    result = BatchResult((GeneratedImage(Image.new("RGB", (48, 64)), 5),), "CPUExecutionProvider", steps_done=3)
    out = Generated([b""], result, 0.0, 0.0, [], "tiny")
    private, shared = image_facts(batch, out, 0, False), image_facts(batch, out, 0, True)
    assert "prompt" not in private and "negative_prompt" not in private
    assert (shared["prompt"], shared["negative_prompt"]) == ("a red fox", "blurry")
    assert private == {"model_served": "tiny", "provider": "CPUExecutionProvider", "index": 0, "seed": 5,
                       "mode": "img2img", "width": 48, "height": 64, "steps": 8, "steps_done": 3,
                       "interrupted": False, "sampler": "dpmpp_2m_karras", "guidance_scale": 6.0, "batch_images": 1,
                       "loras": [], "strength": 0.4}
