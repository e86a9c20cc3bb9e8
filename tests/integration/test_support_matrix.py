"""The support matrix tells the truth (server/cli/matrix.py): every cell is what the code does with the family's
tiny model, the committed README and docs home hold exactly the generated block, a cell whose plan raises says
"not built", and every test the matrix cites as proof exists.

``PROOFS`` is the registry of which test proves which cell; server/cli/matrix.py reads it from here as a literal
(server/ never names a family: tests/unit/test_layout.py). A profile that needs a GPU (production) is never proven
on a CPU: its entries are notes on what the suite checks without one."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from server.cli import matrix

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `make refs` (python -m server.cli.refs) and commit README.md and docs/index.md"

PROOFS: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {
    # (family, profile): ((test node id, what it shows), ...). A plain literal: the generator reads it with ast.
    ("sd1", "dev"): (
        ("tests/integration/test_parity.py::test_images_match_diffusers", "txt2img parity with diffusers per sampler"),
        ("tests/integration/test_edit_parity.py::test_img2img_matches_diffusers", "img2img parity"),
        ("tests/integration/test_edit_parity.py::test_inpaint_4_channel_matches_diffusers", "inpainting parity"),
    ),
    ("sd2", "dev"): (
        ("tests/integration/test_families.py::test_sd2_v_prediction_matches_diffusers",
         "v-prediction parity with diffusers per sampler"),
    ),
    ("sdxl", "dev"): (
        ("tests/integration/test_families.py::test_sdxl_matches_diffusers", "parity with diffusers per sampler"),
        ("tests/integration/test_edit_parity.py::test_sdxl_img2img_matches_diffusers", "img2img parity"),
    ),
    ("turbo", "dev"): (
        ("tests/integration/test_families.py::test_turbo_guidance_zero_matches_diffusers",
         "parity with diffusers at guidance 0, 1 and 4 steps"),
    ),
    ("inpaint", "dev"): (
        ("tests/integration/test_edit_parity.py::test_inpaint_9_channel_matches_diffusers",
         "inpainting parity with diffusers"),
        ("tests/integration/test_edit_parity.py::test_9_channel_model_serves_txt2img_as_a1111",
         "txt2img as A1111 does"),
    ),
    ("flux", "dev"): (
        ("tests/integration/test_dit_parity.py::test_images_match_diffusers", "txt2img parity with diffusers"),
        ("tests/integration/test_dit_parity.py::test_img2img_matches_diffusers", "img2img parity"),
    ),
    ("flux-schnell", "dev"): (
        ("tests/integration/test_dit_parity.py::test_images_match_diffusers", "txt2img parity with diffusers"),
    ),
    ("sd3", "dev"): (
        ("tests/integration/test_dit_parity.py::test_images_match_diffusers", "txt2img parity with diffusers"),
    ),
    ("sd35", "dev"): (
        ("tests/integration/test_dit_parity.py::test_images_match_diffusers", "txt2img parity with diffusers"),
        ("tests/integration/test_dit_parity.py::test_img2img_matches_diffusers", "img2img parity"),
    ),
    ("qwen-image", "dev"): (
        ("tests/integration/test_qwen_parity.py::test_images_match_diffusers",
         "txt2img parity with diffusers, true CFG with negative prompts, two sizes"),
        ("tests/integration/test_qwen_parity.py::test_img2img_matches_diffusers", "img2img parity"),
        ("tests/e2e/test_qwen_serving.py::test_through_the_openai_sdk", "served through the openai SDK"),
    ),
    ("z-image-turbo", "dev"): (
        ("tests/integration/test_zimage_parity.py::test_images_match_diffusers",
         "txt2img parity with diffusers, with and without CFG, two sizes"),
        ("tests/integration/test_zimage_img2img_parity.py::test_img2img_matches_diffusers", "img2img parity"),
    ),
    ("z-image", "dev"): (
        ("tests/e2e/test_zimage_serving.py::test_through_the_openai_sdk", "served through the openai SDK"),
        ("tests/integration/test_zimage_lora.py::test_transformer_lora_images_match_diffusers",
         "LoRA (transformer) matches diffusers; text-encoder LoRA refused by name"),
        ("tests/e2e/test_zimage_serving.py::test_the_a1111_route_uses_the_negative_prompt_and_repeats_a_seed",
         "CFG with negative prompts on the A1111 route (parity: the Turbo row, the same architecture)"),
    ),
    ("flux-kontext", "dev"): (
        ("tests/integration/test_kontext_parity.py::test_instruction_edit_matches_diffusers",
         "instruction-edit parity with diffusers at two input sizes, the output size rule"),
        ("tests/e2e/test_kontext_edits.py::test_one_image_is_an_instruction_edit_that_depends_on_it",
         "the openai client's images.edit, one image, no mask"),
    ),
    ("qwen-image-edit", "dev"): (
        ("tests/integration/test_qwen_edit_parity.py::test_instruction_edit_matches_diffusers",
         "instruction-edit parity with diffusers, one and two input images, true CFG with negative prompts"),
        ("tests/integration/test_qwen_edit_2511_parity.py::test_2511_instruction_edit_matches_diffusers",
         "2511 (zero_cond_t) parity with diffusers, one and two input images"),
    ),
    ("flux2-klein", "dev"): (
        ("tests/integration/test_flux2_parity.py::test_images_match_diffusers", "txt2img parity with diffusers"),
        ("tests/e2e/test_flux2_serving.py::test_through_the_openai_sdk", "served through the openai SDK"),
        ("tests/integration/test_flux2_lora.py::test_transformer_lora_images_match_diffusers",
         "LoRA (transformer) matches diffusers; text-encoder LoRA refused by name"),
        ("tests/integration/test_flux2_refs_parity.py::test_edits_match_diffusers",
         "reference-image edit parity with diffusers, one and two input images"),
        ("tests/e2e/test_flux2_edits.py::test_one_and_two_images_are_instruction_edits_that_depend_on_them",
         "reference-image edits through the openai SDK, one image and a list of two"),
    ),
    ("flux2-klein-base", "dev"): (
        ("tests/integration/test_flux2_parity.py::test_images_match_diffusers",
         "txt2img parity with diffusers, CFG, two sizes"),
    ),
    ("flux2-dev", "dev"): (
        ("tests/integration/test_flux2_dev_parity.py::test_images_match_diffusers",
         "txt2img parity with diffusers, embedded guidance, two sizes"),
        ("tests/e2e/test_flux2_dev_serving.py::test_through_the_openai_sdk", "served through the openai SDK"),
        ("tests/integration/test_flux2_dev_lora.py::test_transformer_lora_matches_diffusers_and_text_encoder_keys_"
         "are_refused", "LoRA (transformer) matches diffusers; text-encoder LoRA refused by name"),
        ("tests/integration/test_flux2_dev_doctor.py::test_an_80_gb_card_is_told_it_does_not_fit_and_what_would",
         "doctor: does not fit an 80 GB card in bf16, says what would"),
        ("tests/integration/test_flux2_dev_refs_parity.py::test_edits_match_diffusers",
         "reference-image edit parity with diffusers, one and two input images"),
    ),
    ("sd1", "openvino"): (
        ("tests/integration/test_plugin_ep.py::test_built_artifacts_boot_on_the_ep",
         "served from EP-context artifacts"),
        ("tests/integration/test_plugin_ep.py::test_a_node_the_ep_leaves_on_the_cpu_exits_22_naming_it",
         "a node left on the CPU refused"),
        ("tests/integration/test_plugin_ep.py::test_artifact_problems_exit_23", "tampered or stale artifacts refused"),
        ("tests/e2e/test_openvino.py::test_watchdog_canaries_run_on_the_ep", "self-test and watchdog on the EP"),
        ("tests/integration/test_lora.py::test_lora_on_the_openvino_profile_runs_every_node_on_the_accelerator",
         "LoRA on the EP"),
        ("tests/integration/test_accept_rehearsal.py::test_accept_runs_end_to_end_on_the_openvino_profile",
         "`sdserve accept` rehearsed"),
    ),
    ("flux", "openvino"): (
        ("tests/e2e/test_dit_serving.py::test_flux_on_openvino_from_ep_context_artifacts",
         "served from EP-context artifacts, every node on the EP"),
        ("tests/integration/test_dit_parity.py::test_every_dit_node_runs_on_the_accelerator_ep",
         "the CPU's images"),
    ),
    ("sd35", "openvino"): (
        ("tests/integration/test_dit_parity.py::test_every_dit_node_runs_on_the_accelerator_ep",
         "every session on the EP under the profile's policy, the CPU's images (plain ONNX: its EP-context "
         "artifacts are planned, not built by a test)"),
    ),
    ("sd1", "cuda"): (
        ("tests/integration/test_cuda_profile.py::test_every_option_set_passes_orts_parser",
         "every option set through ORT's parser"),
        ("tests/integration/test_cuda_profile.py::test_the_placement_audit_under_the_policy",
         "the placement audit's classification under the policy"),
        ("tests/integration/test_cuda_profile.py::test_the_optimized_graphs_are_what_the_profile_serves",
         "`engines optimize --target cuda` graphs verified without TensorRT engines"),
        ("tests/integration/test_cuda_profile.py::test_serve_exits_20_saying_why", "exit 20 without a GPU"),
    ),
    ("flux", "production"): (
        ("tests/integration/test_lora.py::test_a_dit_text_encoder_lora_changes_the_image_it_claims_and_matches_"
         "diffusers", "LoRA incl. text encoders matches diffusers on the CPU"),
        ("tests/integration/test_lora.py::test_under_a_tensorrt_policy_lora_variants_get_the_cuda_provider_only",
         "LoRA variants get the CUDA provider"),
    ),
    ("sd3", "production"): (
        ("tests/integration/test_lora.py::test_a_dit_text_encoder_lora_changes_the_image_it_claims_and_matches_"
         "diffusers", "LoRA incl. text encoders matches diffusers on the CPU"),
        ("tests/integration/test_lora.py::test_under_a_tensorrt_policy_lora_variants_get_the_cuda_provider_only",
         "LoRA variants get the CUDA provider"),
    ),
}


@pytest.fixture(scope="module")
def folders(tiny_family: Callable[[str], Path]) -> dict[str, Path]:
    """Every family's tiny model, built as `make refs` builds them (`sdserve engines tiny`, about a minute), or the
    same export another test built this session (tests/conftest.py ``tiny_family``; nothing here writes to it)."""
    return {family: tiny_family(family) for family in matrix.family_names()}


@pytest.fixture(scope="module")
def generated(folders: dict[str, Path]) -> dict[Path, str]:
    return matrix.generate(folders)


def _columns() -> dict[str, matrix.Column]:
    return {c.profile: c for c in matrix.columns()}


def test_the_committed_blocks_are_the_generated_ones(generated: dict[Path, str]) -> None:
    stale = [p.relative_to(ROOT).as_posix() for p, text in generated.items() if p.read_text(encoding="utf-8") != text]
    assert not stale, f"the support matrix in {', '.join(stale)} differs from what the code does; {FIX}"


def test_every_family_and_profile_has_a_cell(generated: dict[Path, str]) -> None:
    """Rows are what `engines tiny` builds (every registered family and the inpainting UNet), columns the
    shipped profiles; every cell says one of the four levels."""
    from engines.families import REGISTRY
    from server.settings import PROFILES

    names = matrix.family_names()
    assert set(REGISTRY) <= set(names) and "inpaint" in names
    text = generated[ROOT / "README.md"]
    body = text[text.index(matrix.START):text.index(matrix.END)]
    table = [line for line in body.splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == list(names)
    for profile in PROFILES:
        assert f"(`{profile}` profile" in body.splitlines()[1]
    for line in table:
        cells = line.split(" | ")[1:1 + len(PROFILES)]
        assert all(any(c.startswith(f"**{level}**") for level in matrix.LEVELS) for c in cells), line


def test_a_family_the_tensorrt_plan_drops_is_not_built(folders: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's dispatch loses the DiT families (the folder no longer reads as Flux / SD 3): the production
    cell says "not built" with the plan's own reason, and a registered proof cannot raise it."""
    from engines.build import trtplan

    production = _columns()["production"]
    assert matrix.planned(folders["flux"], production)[0].level == "built"
    monkeypatch.setattr(trtplan, "_dit_family", lambda folder: None)
    cell, _ = matrix.planned(folders["flux"], production)
    assert cell.level == "not built" and "no TensorRT plan" in cell.detail
    assert str(folders["flux"]) not in cell.detail  # no machine path in the docs
    proofs = {("flux", "production"): (("tests/x.py::test_y", "anything"),)}
    assert matrix.evidence("flux", production, cell, proofs, {("flux", "production"): "H200"}) == cell


def test_a_unet_input_the_plan_cannot_shape_is_not_built(folders: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's role table loses SDXL's extra UNet inputs: the sdxl cell is refused, sd1's is still built."""
    from engines.build import trtplan

    monkeypatch.setattr(trtplan, "NAMED_ROLES", {})
    production = _columns()["production"]
    assert matrix.planned(folders["sdxl"], production)[0].level == "not built"
    assert matrix.planned(folders["sd1"], production)[0].level == "built"


def test_an_ep_context_plan_that_raises_and_an_engine_that_does_not_load_are_not_built(
        folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from engines.build import epctx
    from engines.errors import ModelLoadError

    def refuse(*args: object, **kwargs: object) -> None:
        raise ModelLoadError("no such family")

    monkeypatch.setattr(epctx, "plan", refuse)
    monkeypatch.setattr("engines.engine.OrtEngine.load", refuse)
    columns = _columns()
    for profile in ("openvino", "dev"):
        cell, info = matrix.planned(folders["sd1"], columns[profile])
        assert cell == matrix.Cell("not built", "", "ModelLoadError: no such family") and info is None
    assert matrix.apis(None) == "not served"


def test_evidence_levels_and_the_gpu_slot(tmp_path: Path) -> None:
    """CPU proofs raise a CPU profile's cell; a GPU profile's stay notes; only a passing recorded GPU run says
    "proven on a GPU"."""
    columns = _columns()
    built = matrix.Cell("built", "planned", "engines")
    proofs = {("sd1", "dev"): (("t::a", "parity"),), ("sd1", "production"): (("t::b", "parser"),)}
    proven = matrix.evidence("sd1", columns["dev"], built, proofs, {})
    assert proven.render() == "**proven on CPU** (`make test`): parity"
    assert matrix.evidence("sd1", columns["production"], built, proofs, {}) == matrix.Cell(
        "built", "planned", "engines; checked without a GPU: parser")
    assert matrix.evidence("sd2", columns["dev"], built, proofs, {}) == built
    runs = tmp_path / matrix.GPU_RUNS
    runs.mkdir(parents=True)
    report = {"family": "sd1", "profile": "production", "verdict": {"status": "pass"}, "node": {"gpu": "H200"}}
    (runs / "sd1.json").write_text(json.dumps(report))
    (runs / "sd2.json").write_text(json.dumps({**report, "family": "sd2", "verdict": {"status": "fail"}}))
    recorded = matrix.gpu_runs(tmp_path)
    assert list(recorded) == [("sd1", "production")]
    cell = matrix.evidence("sd1", columns["production"], built, proofs, recorded)
    assert cell.level == "proven on a GPU" and "H200" in cell.detail
    text = matrix.block([matrix.Row("sd1", "`sd1`", "", (cell,))], [columns["production"]], "docs/")
    assert "GPU runs recorded: 1 of the cells above" in text and "none yet" not in text


def test_the_proof_registry_is_what_the_generator_reads() -> None:
    assert matrix.proofs(ROOT) == PROOFS


def _parametrized_families(function: ast.FunctionDef, module: ast.Module) -> list[str] | None:
    """The families a test is parametrized over (a ``family`` argument), None when it is not."""
    constants = {t.id: n.value for n in module.body if isinstance(n, ast.Assign | ast.AnnAssign) and n.value
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize"):
            continue
        names = [n.strip() for n in ast.literal_eval(decorator.args[0]).split(",")] \
            if isinstance(decorator.args[0], ast.Constant) else list(ast.literal_eval(decorator.args[0]))
        if "family" not in names:
            continue
        values = decorator.args[1]
        if isinstance(values, ast.Call):  # sorted(EDITS)
            values = values.args[0]
        data = ast.literal_eval(constants[values.id] if isinstance(values, ast.Name) else values)
        index = names.index("family")
        return [v[index] if len(names) > 1 else v for v in data]
    return None


CITED = [(cell, proof) for cell, proofs in PROOFS.items() for proof in proofs]


@pytest.mark.parametrize(("cell", "proof"), CITED,
                         ids=[f"{f}-{p}-{proof[0].split('::')[1]}" for (f, p), proof in CITED])
def test_every_proof_names_a_test_that_exists(cell: tuple[str, str], proof: tuple[str, str]) -> None:
    """Each cited test function is in its file; a test parametrized over families runs the cited one."""
    family, profile = cell
    path, _, name = proof[0].partition("::")
    assert family in matrix.family_names() and profile in _columns(), cell
    assert (ROOT / path).is_file(), f"{proof[0]}: no such file"
    module = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    functions = {n.name: n for n in module.body if isinstance(n, ast.FunctionDef)}
    assert name in functions, f"{proof[0]}: no such test function"
    covered = _parametrized_families(functions[name], module)
    assert covered is None or family in covered, f"{proof[0]} runs {covered}, not {family}"
