"""Provenance of edits: each input image is a C2PA ingredient of the signed manifest (its SHA-256, its relationship
as the C2PA specification defines them: parentOf the image edited, componentOf another reference image, inputTo the
mask), with the actions that name them, and `sdserve verify` reads them back. Real c2pa-python, no fakes."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from server.provenance import load_credential, sign_bytes
from server.provenance_stage import ingredient
from server.provenance_verify import verify_bytes
from server.settings import ProvenanceSettings
from tests.provenance_ca import SigningCredential, make_credential


@pytest.fixture(scope="module")
def credential() -> SigningCredential:
    return make_credential()


def _image(seed: int, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((32, 32, 3)) * 255).astype(np.uint8)).save(buffer, fmt)
    return buffer.getvalue()


def test_an_instruction_edit_records_its_parent_and_components(tmp_path: Path, credential: SigningCredential) -> None:
    key, chain, _ = credential.write(tmp_path)
    signer = load_credential(ProvenanceSettings(mode="require", key_file=str(key), chain_file=str(chain)))
    first, second, mask = _image(1), _image(2, "JPEG"), _image(3, "BMP")
    inputs = [ingredient(first, "image", "parentOf"), ingredient(second, "image.1", "componentOf"),
              ingredient(mask, "mask", "inputTo")]
    signed = sign_bytes(signer, _image(0), "image/png", {"seed": 1, "ingredients": inputs}, "1")
    result = verify_bytes(signed, credential.ca_pem.decode())
    assert result.verdict == "trusted", result.problems
    assert result.ingredients == [
        {"title": "image", "format": "image/png", "relationship": "parentOf",
         "sha256": hashlib.sha256(first).hexdigest()},
        {"title": "image.1", "format": "image/jpeg", "relationship": "componentOf",
         "sha256": hashlib.sha256(second).hexdigest()},
        {"title": "mask", "format": "image/bmp", "relationship": "inputTo",
         "sha256": hashlib.sha256(mask).hexdigest()}]
    assert [a["action"] for a in result.actions] == ["c2pa.opened", "c2pa.edited", "c2pa.placed"]
    assert result.generation is not None and result.generation["ingredients"] == inputs
    assert result.as_dict()["ingredients"] == result.ingredients


def test_a_generation_has_no_ingredient_and_is_created(tmp_path: Path, credential: SigningCredential) -> None:
    key, chain, _ = credential.write(tmp_path)
    signer = load_credential(ProvenanceSettings(mode="require", key_file=str(key), chain_file=str(chain)))
    result = verify_bytes(sign_bytes(signer, _image(0), "image/png", {"seed": 1}, "1"), credential.ca_pem.decode())
    assert result.verdict == "trusted" and result.ingredients == []
    assert [a["action"] for a in result.actions] == ["c2pa.created"]
