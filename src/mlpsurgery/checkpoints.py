"""Reading a transformers checkpoint folder: its config, the class to build, its tokenizer, its weight files' headers
checked against the config -- what both `models` (loading a model whole) and `layerwise` (one layer at a time) need.

Below models, layerwise and io: this module imports none of them (tests/test_layering.py). The names callers use
stay importable from where they were (models, layerwise, io.loading).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import IntegrityError, MLPSurgeryError
from .sites.specs import is_encoder_type


def _first_line(e: BaseException, limit: int = 240) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def config_dtype(config) -> torch.dtype | None:
    """The floating dtype config.json names (what transformers' dtype="auto" takes), or None."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) and found.is_floating_point else None


def _config_dtype(config) -> torch.dtype | str:
    """What transformers' dtype="auto" loads a checkpoint in when its config names a floating dtype, else "auto"
    (transformers then looks at the weights itself)."""
    return config_dtype(config) or "auto"


def stock_config_dict(config: dict) -> dict:
    """A folder's config.json as the stock config it extends (what mlpsurgery itself loads)."""
    plan = config.get("mlpsurgery")
    if not isinstance(plan, dict):
        return config
    out = {k: v for k, v in config.items() if k not in ("mlpsurgery", "auto_map")}
    out["model_type"] = plan.get("model_type")
    out["architectures"] = [plan.get("model_class")]
    return out


def read_saved_config(folder: Path):
    """The folder's config as the stock config class of its architecture (a folder with generated modeling code
    has config.json's model_type `mlpsurgery_<type>`: mlpsurgery reads the stock type and never runs that code)."""
    from transformers import CONFIG_MAPPING

    path = folder / "config.json"
    try:
        raw = stock_config_dict(json.loads(path.read_bytes()))
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    except FileNotFoundError:
        raise IntegrityError(f"{folder} has no config.json; restore it from the original save") from None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, AttributeError) as e:
        raise IntegrityError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                             "restore it from the original save") from None


def read_config(folder: Path):
    """The folder's transformers config, or a one-line refusal that says what is wrong with it. A folder mlpsurgery
    wrote is read as `io.load` reads it: the stock config of its architecture, never the generated modeling code
    its config.json may name."""
    from transformers import AutoConfig

    path = folder / "config.json"
    if not path.is_file():
        raise MLPSurgeryError(f"{folder} has no config.json file: not a transformers or mlpsurgery model folder")
    if (folder / "surgery.json").exists():
        return read_saved_config(folder)
    try:
        raw = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MLPSurgeryError(f"{path} is not valid JSON ({_first_line(e)}); restore the model's config.json") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise MLPSurgeryError(f"{path} has no \"model_type\": transformers cannot tell the architecture; restore the "
                              "model's config.json")
    if raw.get("auto_map"):
        raise MLPSurgeryError(f"{folder} needs its own modeling code (auto_map in config.json), which mlpsurgery does not "
                              "run; give a model of an architecture built into transformers")
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MLPSurgeryError(f"{path} cannot be read by transformers ({_first_line(e)}); check the model_type and "
                              "that the installed transformers knows it") from None


def _model_class(config, task: str):
    """The class to load: for task auto, the one the folder's config names in `architectures` (so a checkpoint's
    head -- classifier, masked LM -- is kept), else the causal LM for decoders and the bare encoder for BERT-likes."""
    import transformers as T

    if task == "auto":
        for name in getattr(config, "architectures", None) or []:
            klass = getattr(T, str(name), None)
            if isinstance(klass, type) and issubclass(klass, T.PreTrainedModel):
                return klass
        task = "encoder" if is_encoder_type(config.model_type) else "causal-lm"
    return {"causal-lm": T.AutoModelForCausalLM, "encoder": T.AutoModel,
            "classifier": T.AutoModelForSequenceClassification}[task]


def _numbered_group(names) -> int:
    """The most distinct numbers any one prefix is followed by in tensor names (`x.layer_groups.3.w` -> prefix
    `x.layer_groups`, number 3): the layer count of the largest numbered group, for an architecture without a spec."""
    groups: dict[str, set[str]] = {}
    for n in names:
        parts = n.split(".")
        i = next((k for k, part in enumerate(parts) if part.isdigit()), None)
        if i is not None:
            groups.setdefault(".".join(parts[:i]), set()).add(parts[i])
    return max((len(v) for v in groups.values()), default=0)


def check_weights(folder: Path, config, klass, dtype=None, memory: bool = True) -> None:
    """Refuse, before a model is built, a config.json that does not match the folder's weight files (one edited or
    swapped in from another model), and a model that cannot fit in memory, reading only the files' headers:

    1. the layer count config.json gives against the layer indices the weight names hold (a config edited to a
       million layers would take hours to build, even on the meta device): more layers than the weights hold is
       refused (they would be random); for an architecture without a spec, a count far beyond any numbered group;
    2. the model built on the meta device (no memory), every tensor shape against the files' (a config edited to a
       2^40-wide MLP would otherwise reach the allocator);
    3. with `memory`, its parameters in `dtype` (a torch dtype; "auto" / None: the checkpoint's own / float32)
       against the memory available (resources.check_memory).
    A folder without safetensors or PyTorch weight files is left to transformers."""
    from .resources import check_memory
    from .sites import layer_indices
    from .tensorfiles import checkpoint_layout

    layout = checkpoint_layout(folder)
    if not layout:
        return
    where = folder / "config.json"
    n = getattr(config, "num_hidden_layers", None)
    if isinstance(n, int) and n > 0:
        held = layer_indices(config, layout)
        if held:
            if n > len(held):
                span = f"layer {min(held)}" if len(held) == 1 else f"layers {min(held)}-{max(held)}"
                raise MLPSurgeryError(f"{where} does not match the weights: it says {n} layers, the weight files "
                                      f"hold {len(held)} ({span}); restore the model's config.json")
        else:
            group = _numbered_group(layout)
            if n > 4 * group + 16:
                raise MLPSurgeryError(f"{where} does not match the weights: it says {n} layers, the weight files "
                                      f"number at most {group} of anything; restore the model's config.json")
    try:
        with torch.device("meta"):
            build = getattr(klass, "_from_config", None) or klass.from_config
            skeleton = build(config)
    except Exception:  # noqa: BLE001 - a config transformers cannot build: its own loading words the error
        return
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    for name, t in skeleton.state_dict().items():
        key = next((k for k in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}") if k in layout), None)
        if key is not None and tuple(t.shape) != tuple(layout[key][1]):
            raise MLPSurgeryError(f"{where} does not match the weights: {key} is {tuple(layout[key][1])} in the weight "
                                  f"files, config.json makes it {tuple(t.shape)}; restore the model's config.json")
    if not memory:
        return
    params = sum(p.numel() for p in skeleton.parameters())
    if isinstance(dtype, torch.dtype):
        item = dtype.itemsize
    elif dtype == "auto":
        own = config_dtype(config)
        item = own.itemsize if own is not None else min(
            (d.itemsize for d, _ in layout.values() if d.is_floating_point), default=4)
    else:
        item = 4
    from .report import human_count

    check_memory(params * item, f"{folder} ({human_count(params)} parameters, {item} bytes each)",
                 "load it layer by layer (--layerwise, where the command has it), in a smaller --dtype, or on a "
                 "machine with more memory")


def _tokenizer(folder: Path):
    """The folder's tokenizer, or None when it has none (commands that need text then say so). The config is given
    to transformers (for a folder with generated modeling code, the stock one): never a remote-code prompt."""
    from transformers import AutoTokenizer

    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    try:
        # config.json may name generated code: give the stock config (read_config)
        kw = {"config": read_config(folder)} if (folder / "surgery.json").exists() else {}
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False, **kw)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MLPSurgeryError(f"the tokenizer files in {folder} cannot be read ({_first_line(e)}); restore them") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    from .resources import trim_heap

    trim_heap()  # the tokenizer's loading frees tens of MB of small pieces, which glibc would otherwise keep
    return tok
