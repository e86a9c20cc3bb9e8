"""Model and engine artifacts: manifests bound to the version matrix, verified at boot.

A model folder's ``manifest.json`` lists every file with its sha256 and size. Boot refuses a folder where a listed
file is missing or changed *and* one that holds a file the manifest does not list, so deleting an entry from the
manifest cannot hide a file. Only the manifest itself cannot list its own digest: pin it with
``runtime.manifest_sha256`` and an edited manifest is refused too.

Exempt from the model manifest, on purpose (``MODEL_EXEMPT``):

- ``manifest.json``: it cannot hash itself; the pinned digest covers it.
- ``selftest.json``: written after the manifest, on the serving node, by ``sdserve selftest --record``. It holds canary
  fingerprints, never code or weights: editing it can only make the self-test fail (loudly), never let a changed
  weight through, since the weights are hashed here.
- ``trt/``: written after the manifest by ``sdserve engines build`` on a GPU node, with its own manifest (below).
- ``ep/``: the same for plugin execution providers, one folder per EP (``ep/OpenVINOExecutionProvider/``).

TensorRT engines live in ``<model>/trt/``: one subfolder per served size (``trt/512x512/``) holding the EP-context
model of each component and its ``engines/`` cache, and one ``trt/manifest.json`` with the profiles, build flags, the
ORT / CUDA / cuDNN / TensorRT versions, GPU and driver they were built with, the sha256 of each source model, and
every file's sha256 and size. In production the server never builds an engine on the node: a manifest that does not
match the live node, or the model it was built from, is refused, naming each difference.

A plugin EP's EP-context artifacts (``sdserve engines build --profile openvino``) have the same layout under
``ep/<EP name>/``: per size the context models (one EPContext node each) and the blobs they name, one manifest
bound to the ONNX Runtime version, the plugin's package, its version (pip and loaded library) and device type.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from engines.errors import ArtifactError

TRT_DIR = "trt"
EP_DIR = "ep"
MANIFEST = "manifest.json"
MODEL_EXEMPT = (MANIFEST, "selftest.json", TRT_DIR, EP_DIR)
"""Top-level names of a model folder that its manifest does not cover (see the module docstring for why)."""
COMPONENTS = ("text_encoder", "unet", "vae_decoder")
VerifyMode = Literal["full", "size", "off"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _on_disk(folder: Path, exempt: tuple[str, ...]) -> list[str]:
    """Every file under ``folder`` (posix, relative), except top-level names in ``exempt`` (files or folders)."""
    rels = (p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*")) if p.is_file())
    return [rel for rel in rels if rel.split("/", 1)[0] not in exempt]


def file_table(folder: Path, exempt: tuple[str, ...] = (MANIFEST,)) -> dict[str, dict[str, Any]]:
    """``path: {sha256, bytes}`` for every file under ``folder`` but the top-level names in ``exempt``."""
    return {rel: {"sha256": sha256_file(folder / rel), "bytes": (folder / rel).stat().st_size}
            for rel in _on_disk(folder, exempt)}


def write_model_manifest(folder: Path, data: dict[str, Any]) -> Path:
    """``folder/manifest.json``: ``data`` plus the table of every file (sizes and sha256), keys sorted, no
    timestamps (the same inputs give the same manifest, byte for byte)."""
    path = folder / MANIFEST
    body = {**data, "format": 2, "files": file_table(folder, MODEL_EXEMPT)}
    path.write_text(json.dumps(body, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    return path


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"manifest {path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"manifest {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ArtifactError(f"manifest {path} has no files table")
    return data


def expected(entry: Any) -> tuple[str, int | None]:
    """(sha256, bytes) of a manifest entry. Format 1 model manifests stored ``path: sha256`` (no size)."""
    if isinstance(entry, str):
        return entry, None
    return str(entry["sha256"]), int(entry["bytes"]) if "bytes" in entry else None


def _check_file(path: Path, rel: str, entry: Any, mode: VerifyMode) -> str | None:
    digest, size = expected(entry)
    if not path.is_file():
        return f"{rel}: missing"
    actual = path.stat().st_size
    if size is not None and actual != size:
        return f"{rel}: {actual} bytes, manifest says {size}"
    if mode == "size" and size is None:
        return f"{rel}: the manifest records no size (format 1): re-export the model to record sizes"
    if mode == "full" and (found := sha256_file(path)) != digest:
        return f"{rel}: sha256 {found[:12]}… differs from the manifest's {digest[:12]}…"
    return None


def verify_files(folder: Path, manifest: dict[str, Any], mode: VerifyMode,
                 exempt: tuple[str, ...] = (MANIFEST,)) -> list[str]:
    """Differences between the folder and the manifest, each naming the file: listed files missing, of another size
    or (full) another sha256, and files on disk the manifest does not list. Empty when they match."""
    if mode == "off":
        return []
    listed: dict[str, Any] = manifest.get("files", {})
    problems = [p for rel, entry in sorted(listed.items()) if (p := _check_file(folder / rel, rel, entry, mode))]
    problems += [f"{rel}: not in the manifest" for rel in _on_disk(folder, exempt) if rel not in listed]
    return problems


def check_manifest_digest(path: Path, pinned: str) -> None:
    """The manifest file's sha256 against the digest pinned in the profile or deployment."""
    if not path.is_file():
        raise ArtifactError(f"manifest {path} is missing")
    found = sha256_file(path)
    if found != pinned.lower():
        raise ArtifactError(f"{path}: sha256 {found} is not the pinned runtime.manifest_sha256 {pinned}: the "
                            "manifest was edited, or this is another model")


def verify_model(folder: Path, mode: VerifyMode, pinned: str | None = None) -> None:
    """The model folder against its manifest.json (and the manifest against ``pinned``, its sha256, when given);
    raises ArtifactError naming every file that differs."""
    if mode == "off":
        return
    if pinned:
        check_manifest_digest(folder / MANIFEST, pinned)
    problems = verify_files(folder, read_manifest(folder / MANIFEST), mode, MODEL_EXEMPT)
    if problems:
        raise ArtifactError(f"model folder {folder} does not match its manifest: " + "; ".join(problems))


NODE_KEYS = ("onnxruntime", "cuda", "cudnn_major", "tensorrt", "compute_capability")
PLUGIN_NODE_KEYS = ("onnxruntime", "ep", "ep_package", "ep_version", "ep_library_version", "device_type")
"""What a plugin EP's artifacts are bound to: a blob compiled by one EP version is not another's."""


def ep_dir(name: str) -> str:
    """The artifact folder of plugin EP ``name``, relative to the model folder."""
    return f"{EP_DIR}/{name}"


def plugin_identity(observations: dict[str, Any], device_type: str) -> dict[str, str | None]:
    """What plugin-EP artifacts are bound to, from preflight observations (the plugin's package, the version its
    pip metadata and its loaded library report, the device type)."""
    plugin = observations.get("plugin") or {}
    return {"onnxruntime": observations.get("onnxruntime"), "ep": plugin.get("name"),
            "ep_package": plugin.get("package"), "ep_version": plugin.get("package_version"),
            "ep_library_version": plugin.get("library_version"), "device_type": device_type}


def node_identity(observations: dict[str, Any], nvml_index: int) -> dict[str, str | None]:
    """What an engine is bound to, read from preflight observations; ``nvml_index``: the served device's NVML index
    (matched by PCI bus id, OrtEngine.nvml_index), looked up by index, never by list position or CUDA ordinal."""
    devices = observations.get("nvml", {}).get("devices", [])
    device: dict[str, Any] = next((d for d in devices if d.get("index") == nvml_index), {})
    cudnn = observations.get("cudnn", {}).get("version")
    trt = observations.get("tensorrt", {}).get("version")
    return {"onnxruntime": observations.get("onnxruntime"), "cuda": observations.get("onnxruntime_cuda_build"),
            "cudnn_major": cudnn.split(".")[0] if cudnn else None,
            "tensorrt": ".".join(trt.split(".")[:2]) if trt else None,
            "compute_capability": device.get("compute_capability"), "gpu": device.get("name"),
            "driver": observations.get("nvml", {}).get("driver_version")}


def compare_node(built: dict[str, Any], live: dict[str, Any], keys: tuple[str, ...] = NODE_KEYS) -> list[str]:
    """Each binding key whose artifact value differs from the node's, naming both."""
    return [f"{key}: artifact built with {built.get(key)!s}, this node has {live.get(key) or 'none'}"
            for key in keys if str(built.get(key)) != str(live.get(key))]


def external_files(model: Path) -> list[str]:
    """The external-data files an ONNX model's initializers point at (``location`` entries), relative to its
    folder, read from the graph without loading a weight."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    found = {entry.value for init in graph.initializer if init.data_location == onnx.TensorProto.EXTERNAL
             for entry in init.external_data if entry.key == "location"}
    return sorted(found)


def source_files(folder: Path, source: str) -> dict[str, str]:
    """``rel -> sha256`` of a component's model file and every external weight file it reads: what an engine is
    built from. Hashing ``model.onnx`` alone misses a re-exported fine-tune, whose graph file is unchanged when
    its weights are external."""
    path = folder / source
    rels = [source, *(f"{Path(source).parent.as_posix()}/{f}" for f in external_files(path))]
    return {rel: sha256_file(folder / rel) for rel in rels}


def compare_model(engines: dict[str, Any], folder: Path) -> list[str]:
    """Each component whose engines were built from other files than the ones the model manifest lists: the
    graph (``model``, by component) and every file it was built from (``sources``, graph and external weights by
    path; a weight file the model folder lists for a component but the engines were not built from counts too)."""
    path = folder / MANIFEST
    listed = json.loads(path.read_text(encoding="utf-8")).get("files", {}) if path.is_file() else {}
    problems = []
    for component, digest in sorted(engines.get("model", {}).items()):
        entry = listed.get(f"{component}/model.onnx")
        if entry is not None and expected(entry)[0] != digest:
            problems.append(f"{component}: engines built from sha256 {str(digest)[:12]}…, the model folder has "
                            f"{expected(entry)[0][:12]}…")
    for rel, digest in sorted(engines.get("sources", {}).items()):
        entry = listed.get(rel)
        if entry is None or expected(entry)[0] != digest:
            found = "no such file" if entry is None else f"{expected(entry)[0][:12]}…"
            problems.append(f"{rel}: engines built from sha256 {str(digest)[:12]}…, the model folder has {found} "
                            "(weights changed: rebuild the engines)")
    return problems


@dataclass(frozen=True)
class LinkedTree:
    """What :func:`link_tree` did: files hard-linked and files copied (another filesystem), with their bytes."""

    linked: int
    linked_bytes: int
    copied: int
    copied_bytes: int


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = (TRT_DIR, EP_DIR),
              copy: tuple[str, ...] = (MANIFEST, "selftest.json")) -> LinkedTree:
    """``src`` reproduced at ``dst`` by hard links (no byte copied on one filesystem; a 67 GB fp32 Flux folder
    costs inodes, not disk), falling back to a copy per file where a link is refused (EXDEV: another filesystem;
    EPERM/EMLINK). Top-level ``skip`` folders (built artifacts) are left out: what is built next is written fresh,
    never through a link into the source's files; top-level ``copy`` files (the ones a node may rewrite, such as
    recorded fingerprints) are copied, so a write there never reaches the source."""
    counts = [0, 0, 0, 0]
    dst.mkdir(parents=True)
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in skip:
            continue
        target = dst / rel
        if path.is_dir() and not path.is_symlink():
            target.mkdir(exist_ok=True)
            continue
        size = path.stat().st_size
        try:
            if len(rel.parts) == 1 and rel.name in copy:
                raise OSError(errno.EPERM, "copied, not linked")
            os.link(path, target, follow_symlinks=True)
            counts[0], counts[1] = counts[0] + 1, counts[1] + size
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            shutil.copy2(path, target)
            counts[2], counts[3] = counts[2] + 1, counts[3] + size
    return LinkedTree(*counts)


def _relative_inside(rel: str) -> bool:
    return bool(rel) and not rel.startswith("/") and ".." not in Path(rel).parts


def context_problems(ctx_model: Path, rel: str, listed: dict[str, Any]) -> list[str]:
    """An EP-context model's EPContext nodes must name their engine by a path relative to the context model's folder,
    inside it, and listed in the engine manifest. ORT refuses the rest when it loads the model:
    onnxruntime/core/providers/tensorrt/onnx_ctx_model_helper.cc, TensorRTCacheModelHandler::GetEpContextFromGraph
    ("the ep_cache_context attribute should be set with a relative path", "'..' ... not allowed"); the engine path is
    joined to the context model's folder (GetPathOrParentPathOfCtxModel), which is what makes the folder movable."""
    import onnx

    base = Path(rel).parent
    problems = []
    for node in onnx.load(str(ctx_model), load_external_data=False).graph.node:
        if node.op_type != "EPContext":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("embed_mode", 1):
            continue  # engine bytes embedded in the node: covered by the context model's own hash
        cache = attrs.get("ep_cache_context", b"")
        cache = cache.decode() if isinstance(cache, bytes) else str(cache)
        if not _relative_inside(cache):
            problems.append(f"{rel}: ep_cache_context {cache!r} is not a relative path inside {base.as_posix()}/ "
                            "(ORT refuses absolute and '..' paths; rebuild with `sdserve engines build`)")
        elif (base / cache).as_posix() not in listed:
            problems.append(f"{rel}: engine {(base / cache).as_posix()} is not in the engine manifest")
    return problems


def context_models(folder: Path, sub: str = TRT_DIR) -> dict[str, dict[str, Path]]:
    """Per served size (``"512x512"``), each component's EP-context model, from ``<model>/trt/manifest.json``.

    One engine per size: ORT 1.31's TensorRT provider parses several optimization profiles (ParseProfileShapes,
    onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_utils.h) but keeps its execution context on profile
    0 (open PR microsoft/onnxruntime#31624), so a second size in one engine would fail at run time. The engine loads,
    per size, the context models named here. Empty when there is no engine manifest. ``sub``: the artifact folder
    (``trt``, or ``ep/<EP name>`` for a plugin EP)."""
    trt = folder / sub
    if not (trt / MANIFEST).is_file():
        return {}
    sizes: dict[str, Any] = read_manifest(trt / MANIFEST).get("sizes", {})
    out: dict[str, dict[str, Path]] = {}
    for size, entry in sorted(sizes.items()):
        paths = entry.get("context_models", {})
        bad = [str(rel) for rel in paths.values() if not _relative_inside(str(rel))]
        if bad:
            raise ArtifactError(f"engine manifest {trt / MANIFEST}: context model paths {bad} must be relative "
                                f"inside {sub}/")
        out[size] = {component: trt / str(rel) for component, rel in sorted(paths.items())}
    return out


def verify_engines(folder: Path, live: dict[str, Any], mode: VerifyMode, sub: str = TRT_DIR,
                   keys: tuple[str, ...] = NODE_KEYS) -> dict[str, Any]:
    """``<model>/trt`` (or ``<model>/<sub>``): manifest bound to this node's versions and GPU (``keys`` of
    ``live``) and to this model's files, every file intact and listed, every context model pointing at an engine
    inside its folder."""
    trt = folder / sub
    manifest = read_manifest(trt / MANIFEST)
    problems = compare_node(manifest.get("node", {}), live, keys)
    if problems:
        raise ArtifactError(f"the prebuilt artifacts in {sub}/ do not match this node (rebuild them with `sdserve "
                            "engines build` on the deployed versions): " + "; ".join(problems))
    problems = compare_model(manifest, folder) + verify_files(trt, manifest, mode)
    if mode != "off" and not problems:
        for paths in context_models(folder, sub).values():
            for ctx in paths.values():
                rel = ctx.relative_to(trt).as_posix()
                problems += context_problems(ctx, rel, manifest["files"]) if ctx.is_file() else [f"{rel}: missing"]
    if problems:
        raise ArtifactError(f"prebuilt artifacts in {trt} do not match their manifest: " + "; ".join(problems))
    return {"path": str(trt), "profiles": manifest.get("profiles", []),
            "cache_read_only": not os.access(trt, os.W_OK), "build_placement": manifest.get("placement", {})}


def write_engine_manifest(trt: Path, node: dict[str, Any], sizes: dict[str, dict[str, Any]],
                          flags: dict[str, Any], model: dict[str, str],
                          placement: dict[str, dict[str, int]] | None = None,
                          sources: dict[str, str] | None = None) -> Path:
    """``trt/manifest.json``. ``sizes``: per size key, ``{"profile": {...}, "context_models": {component: rel}}``
    with paths relative to ``trt/`` (nothing absolute: the model folder may be moved or mounted elsewhere).
    ``placement``: per component, the source graph's nodes by provider as the build compiled it. ``sources``:
    ``rel -> sha256`` of every file the engines were built from, external weights included (source_files)."""
    path = trt / MANIFEST
    data = {"format": 2, "model": model, "node": node, "sizes": sizes,
            "profiles": [entry["profile"] for _, entry in sorted(sizes.items())], "build_flags": flags,
            "files": file_table(trt), **({"placement": placement} if placement else {}),
            **({"sources": sources} if sources else {})}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def context_model_problems(ctx: Path, source: Path) -> list[str]:
    """What a written EP-context model must be, checked by reopening it: exactly one node, an EPContext node, with
    the source model's graph inputs and outputs (names and element types, in order). A context model holding
    several partitions, or one that dropped an input, would load and serve something else than was built."""
    import onnx

    built = onnx.load(str(ctx), load_external_data=False).graph
    origin = onnx.load(str(source), load_external_data=False).graph

    def signature(values: Any, skip: set[str]) -> list[tuple[str, int]]:
        return [(v.name, v.type.tensor_type.elem_type) for v in values if v.name not in skip]

    initializers = {i.name for i in origin.initializer}
    problems = []
    ops = [f"{n.domain or 'ai.onnx'}.{n.op_type}" for n in built.node]
    if ops != ["com.microsoft.EPContext"]:
        problems.append(f"{ctx.name}: {len(ops)} node(s) {ops[:5]}, expected one com.microsoft.EPContext node")
    if signature(built.input, set()) != signature(origin.input, initializers):
        problems.append(f"{ctx.name}: inputs {signature(built.input, set())} differ from the source's "
                        f"{signature(origin.input, initializers)}")
    if signature(built.output, set()) != signature(origin.output, set()):
        problems.append(f"{ctx.name}: outputs {signature(built.output, set())} differ from the source's "
                        f"{signature(origin.output, set())}")
    return problems
