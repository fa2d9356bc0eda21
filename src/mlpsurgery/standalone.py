"""Self-contained folders: the modeling code that lets stock transformers load a folder whose structure is
not stock (DLR-Nets, nested linears, fused MLPs, per-layer widths, per-layer head counts).

A folder written by `io.save` whose model differs from the stock architecture also holds:
    modeling_mlpsurgery.py    the config class and a subclass of the saved model class (and of its base model)
                              that installs the recorded modules after the stock __init__
    mlpsurgery_*.py           copies of the mlpsurgery files that define those modules (modules/*.py, errors.py),
                              their relative imports pointed at each other: nothing but torch and transformers
and config.json gets `model_type: mlpsurgery_<type>`, an `auto_map` and the module plan (`mlpsurgery`), so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)   # the same model, exactly

while without `trust_remote_code` transformers refuses the folder (its model type is unknown to it and the
folder holds custom code): never a model with randomly initialised MLPs. mlpsurgery itself never runs these
files; `io.load` rebuilds from its own code and the manifest, and the files are checksummed with the rest.

The copied files are mlpsurgery's own module files, so there is one definition of each module. What keeps
them copyable (tests/test_standalone.py checks it): a file under modules/ imports only the standard library,
torch, transformers, `..errors` and its siblings; a name it takes from the rest of the library (MLPWeights) is
used only in methods that inference never calls, and such imports are dropped from the copies.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from . import __version__
from .errors import MLPSurgeryError

PREFIX = "mlpsurgery_"
MODELING = "modeling_mlpsurgery.py"
# Library names a module file may import for methods inference never calls (dropped from the copies).
LIBRARY_ONLY = {("..sites", "MLPWeights")}
# transformers' auto class for each of its mapping tables (text models).
AUTO_CLASSES = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
                ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
                ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
                ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "AutoModelForTokenClassification"),
                ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "AutoModelForQuestionAnswering"),
                ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "AutoModelForMultipleChoice"),
                ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "AutoModelForPreTraining"),
                ("MODEL_MAPPING_NAMES", "AutoModel"))
STOCK = {"Identity", "Linear", "Conv1D"}  # built by modules/base.build from transformers and torch alone


# --------------------------------------------------------------------------------------------------
# Copies of the module files


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def _file_of(module_name: str) -> Path:
    """mlpsurgery.modules.dense -> .../modules/dense.py"""
    mod = sys.modules[module_name]
    return Path(mod.__file__)


def _copy_name(path: Path) -> str:
    """modules/dense.py -> mlpsurgery_dense; errors.py -> mlpsurgery_errors."""
    return PREFIX + path.stem


def _resolve(importer: Path, node: ast.ImportFrom) -> Path | None:
    """The file a relative import names (None for a package __init__ that is not copyable)."""
    base = importer.parent
    for _ in range(node.level - 1):
        base = base.parent
    target = base.joinpath(*(node.module or "").split(".")) if node.module else base / "__init__"
    return target.with_suffix(".py")


def _rewrite(path: Path, seen: dict[Path, str]) -> None:
    """Add `path` (and, recursively, the files it imports relatively) to `seen` as copyable source."""
    if path in seen:
        return
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    seen[path] = ""  # placeholder against cycles
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        if node not in tree.body:
            raise MLPSurgeryError(f"{path.name} imports {'.' * node.level}{node.module} inside a function: a folder's "
                                  "copy of it could not be loaded by transformers alone (this is a bug in mlpsurgery)")
        spec = "." * node.level + (node.module or "")
        names = [a.name for a in node.names]
        if all((spec, n) in LIBRARY_ONLY for n in names):
            edits.append((node.lineno, node.end_lineno, ""))
            continue
        target = _resolve(path, node)
        if target is None or not target.exists() or target.name == "__init__.py":
            raise MLPSurgeryError(f"{path.name} imports {spec}, which a folder's copy cannot carry (this is a bug in "
                                  "mlpsurgery)")
        _rewrite(target, seen)
        alias = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        edits.append((node.lineno, node.end_lineno, f"from .{_copy_name(target)} import {alias}\n"))
    for start, end, new in sorted(edits, reverse=True):
        lines[start - 1:end] = [new]
    head = f"# Copied by mlpsurgery {__version__} from mlpsurgery/{path.relative_to(_package_dir())}; " \
           "relative imports point at the copies beside it.\n"
    seen[path] = head + "".join(lines)


def module_files(classes: set[str]) -> dict[str, str]:
    """file name -> source of every mlpsurgery file the given module classes need (registered classes only)."""
    from .modules import MODULES

    seen: dict[Path, str] = {}
    _rewrite(_file_of("mlpsurgery.modules.base"), seen)
    for name in sorted(classes - STOCK):
        klass = MODULES.get(name)
        if klass is None:
            raise MLPSurgeryError(f"{name} is not a registered mlpsurgery module")
        _rewrite(_file_of(klass.__module__), seen)
    return {_copy_name(p) + ".py": text for p, text in seen.items()}


# --------------------------------------------------------------------------------------------------
# The model file


def _auto_names(model_type: str, class_name: str) -> list[str]:
    """The auto classes under which transformers lists `class_name` for `model_type`."""
    import transformers.models.auto.modeling_auto as ma

    return [auto for table, auto in AUTO_CLASSES if getattr(ma, table, {}).get(model_type) == class_name]


MODEL_TEMPLATE = '''"""Generated by mlpsurgery {version} for this folder: stock transformers builds the model with
`{auto}.from_pretrained(folder, trust_remote_code=True)`. The config's `mlpsurgery` entry lists the modules that
differ from a stock {model_class}; the mlpsurgery_*.py files beside this one define them (copied from
mlpsurgery). Imports: torch and transformers only.
"""

from torch import nn
from transformers import {imports}

from .mlpsurgery_base import build
{module_imports}

class MlpsurgeryConfig({config_class}):
    model_type = "{model_type}"


def apply_surgery(model: nn.Module, plan: dict, prefix: str = "") -> None:
    """Install the recorded modules (weights come from the checkpoint). `prefix`: the path of this model inside
    the saved one (a bare model built from a folder saved with a head)."""
    for entry in plan["modules"]:
        path = entry["path"]
        if prefix:
            if not path.startswith(prefix + "."):
                continue  # outside the bare model (e.g. a head)
            path = path[len(prefix) + 1:]
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, name, build(entry["class"], entry.get("config", {{}})))


class _Surgery:
    """Mixed into the stock classes below: the recorded structure, and the runtime rank of nested layers."""

    config_class = MlpsurgeryConfig
    _prefix = ""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        apply_surgery(self, config.mlpsurgery, self._prefix)
{nested_methods}
{classes}'''

NESTED_METHODS = '''
    def nested_layers(self) -> dict:
        """path -> NestedLinear (Nested Subspace Networks: the rank is chosen at inference)."""
        return {{p: m for p, m in self.named_modules() if isinstance(m, NestedLinear)}}

    def set_rank(self, rank: int) -> int:
        """Run every nested layer at min(rank, its max_rank); no weight is copied."""
        rank_all(self.nested_layers().values(), rank)
        return rank

    def set_budget(self, fraction: float) -> int:
        """Run at the largest rank whose FLOPs fit `fraction` of the dense FLOPs of the nested layers."""
        rank = rank_for_budget(self.nested_layers().values(), fraction)
        return self.set_rank(rank)

    def nested_flops(self) -> dict:
        return flops_of(self.nested_layers().values())
'''


def modeling_source(model: nn.Module, classes: set[str]) -> tuple[str, dict[str, str]]:
    """(modeling_mlpsurgery.py's source, auto_map) for `model`'s class."""
    import transformers

    klass = type(model)
    cfg_class = type(model.config)
    model_type = model.config.model_type
    wrapped = [(klass, "")]
    prefix = getattr(klass, "base_model_prefix", "")
    base = type(getattr(model, prefix)) if prefix and hasattr(model, prefix) and \
        isinstance(getattr(model, prefix), transformers.PreTrainedModel) else None
    if base is not None and base is not klass:
        wrapped.append((base, prefix))
    auto_map = {"AutoConfig": "modeling_mlpsurgery.MlpsurgeryConfig"}
    blocks = []
    for k, pfx in wrapped:
        if getattr(transformers, k.__name__, None) is not k:
            raise MLPSurgeryError(f"{k.__name__} is not a class transformers exports; the folder cannot carry "
                                  "modeling code for it (load it with mlpsurgery.load)")
        name = "Mlpsurgery" + k.__name__
        blocks.append(f"\n\nclass {name}(_Surgery, {k.__name__}):\n    _prefix = {pfx!r}\n")
        for auto in _auto_names(model_type, k.__name__):
            auto_map.setdefault(auto, f"modeling_mlpsurgery.{name}")
    first = [a for a in auto_map if a != "AutoConfig"]
    if not first:
        raise MLPSurgeryError(f"transformers has no auto class for {klass.__name__} ({model_type}); the folder cannot "
                              "be loaded through transformers' auto classes (load it with mlpsurgery.load)")
    from .modules import MODULES

    used = sorted(classes - STOCK)
    module_imports = "".join(f"from .{PREFIX}{Path(sys.modules[MODULES[c].__module__].__file__).stem} import {c}\n"
                             for c in used)
    nested = "NestedLinear" in used
    if nested:
        module_imports += f"from .{PREFIX}nested import flops_of, rank_all, rank_for_budget\n"
    names = sorted({cfg_class.__name__, *(k.__name__ for k, _ in wrapped)})
    source = MODEL_TEMPLATE.format(
        version=__version__, auto=first[0], model_class=klass.__name__, imports=", ".join(names),
        module_imports=module_imports, config_class=cfg_class.__name__, model_type=f"mlpsurgery_{model_type}",
        nested_methods=NESTED_METHODS.format() if nested else "", classes="".join(blocks))
    return source, auto_map


def write(folder: Path, model: nn.Module, entries: list[dict[str, Any]]) -> list[str]:
    """Write the modeling files into `folder` (which already holds config.json) and point config.json at them.
    Returns the names of the files written."""
    classes = {e["class"] for e in entries}
    files = module_files(classes)
    source, auto_map = modeling_source(model, classes)
    files[MODELING] = source
    for name, text in files.items():
        (folder / name).write_text(text)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["mlpsurgery"] = {"model_type": config["model_type"], "model_class": type(model).__name__,
                            "version": __version__, "modules": entries}
    config["model_type"] = f"mlpsurgery_{config['model_type']}"
    config["auto_map"] = auto_map
    config["architectures"] = [auto_map[next(a for a in auto_map if a != "AutoConfig")].split(".")[1]]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(files)
