"""mlpsurgery: surgery on the MLP blocks and attention heads of pretrained transformers.

    import mlpsurgery as ms
    loaded = ms.load_model()                      # SmolLM2-135M (or a folder, a .gguf, "minilm", "tiny:llama")
    ms.inspect(loaded.model)                      # sites, params and FLOPs per token
    corpus = ms.load_corpus(None, loaded.tokenizer)          # bundled Austen, Persuasion held out
    ms.perplexity(loaded.model, corpus.heldout, block_len=512)
    ms.save(loaded.model, "out/"); again = ms.load("out/")   # manifest + safetensors, strict reload
"""

__version__ = "0.1.0"

from .adapters import lora_config, lora_targets
from .capture import Capture, capture_mlp_io
from .data import LabelledSet, TokenizedCorpus, load_corpus, read_corpus, read_labelled, text_blocks, tokenize_corpus
from .errors import IntegrityError, MLPSurgeryError, NotExportableError, UnsupportedArchitectureError
from .io import export, load, save, to_stock
from .subsets import subset_model
from .measure.accuracy import accuracy, embed, probe_accuracy
from .measure.cost import compare_cost, count_params, flops_per_token, inspect, max_batch, measure_cost
from .measure.ntk import adam_ntk, ntk_error, output_error
from .measure.perplexity import perplexity
from .methods.corelocker import (CoreLockerConfig, find_ratio, lock_folder, lock_key, read_key, save_key,
                                 unlock_folder, unlock_key, utility_curve)
from .methods.fusion import FusionConfig, fuse, kmeans
from .methods.nsn import NSNConfig, NSNTrainConfig, nest, set_budget, set_rank, train_nsn
from .methods.pruning import prune
from .methods.twist import TwISTConfig, twist_extract, twist_train
from .models import load_model
from .modules.nested import NestedLinear
from .sites import SUPPORTED, AttnWeights, MLPWeights, find_sites, generic_layers
from .train import FitConfig, fit

__all__ = [
    "__version__", "Capture", "capture_mlp_io", "LabelledSet", "TokenizedCorpus", "load_corpus", "read_corpus",
    "read_labelled", "text_blocks", "tokenize_corpus", "IntegrityError", "MLPSurgeryError", "NotExportableError",
    "UnsupportedArchitectureError", "export", "load", "save", "to_stock", "accuracy", "embed", "probe_accuracy",
    "compare_cost", "count_params", "flops_per_token", "inspect", "max_batch", "measure_cost", "perplexity",
    "load_model", "SUPPORTED", "AttnWeights", "MLPWeights", "find_sites", "generic_layers", "FitConfig", "fit",
    "NSNConfig", "NSNTrainConfig", "nest", "set_budget", "set_rank", "train_nsn", "NestedLinear",
    "CoreLockerConfig", "find_ratio", "lock_folder", "lock_key", "read_key", "save_key", "unlock_folder", "unlock_key",
    "utility_curve", "adam_ntk", "ntk_error", "output_error", "FusionConfig", "fuse", "kmeans",
    "subset_model", "prune", "TwISTConfig", "twist_extract", "twist_train", "lora_config", "lora_targets",
]
