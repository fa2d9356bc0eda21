"""CoreLocker (papers/corelocker.txt): extract the most important weights of a trained model as an
access key. Without the key the model falls to a chosen utility (down to chance, 1/C); with it the
model is restored bit for bit.

Extraction (the paper's Definition 1): rank candidate *units* by an *indicator* and zero the top
`ratio` fraction of them (the paper's extraction ratio 1 - alpha; `ratio` counts units, not bytes).

    unit     weight   one entry of a weight matrix
             neuron   an MLP inner neuron: its up/gate rows, biases and down column (transformers), or
                      an output neuron of a hidden Linear with what consumes it (plain PyTorch models)
             head     an attention head: its q slice and output-projection slice, and its k/v slices
                      when it has its own KV group (without grouped-query attention)
             filter   an output channel of a hidden conv: the filter, its bias, the normalisation
                      channel after it and the next conv's / linear's input slice that reads its
                      feature map (the paper's steps 1-4)
    indicator l1      |w| for a weight, the sum of |w| over the unit's weights otherwise
             scale    normalisation scale factors |gamma|: for filters / neurons, the gamma of the
                      norm channel right after them (BatchNorm in CNNs); with unit=weight, and always
                      in transformers, the units are the norm channels themselves (gamma_c and beta_c of
                      every LayerNorm / RMSNorm inside the layers: the transformer analogue of a BN
                      channel). No per-weight computation.
             random   the paper's baseline: the same number of units, uniformly at random (seeded)
    scope    global   one ranking across every eligible layer (the paper's default)
             layer    the top `ratio` of each layer (each matrix, MLP, attention or norm) separately

Input and output layers (embeddings, LM head / classifier; in plain models the first and last weight
layer) are left alone unless `include_io`. Transformers are reached only through the sites layer:
weights through `MLPSite.read/linears` and `AttnSite.read/linears`, positions inside fused or
transposed storage by reading a float64 shadow copy of the layer whose parameters hold their own flat
indices (so no layout knowledge is repeated here). Plain PyTorch models go through `generic_layers`;
which norm channel and which consumer belong to a filter comes from a `torch.fx` trace of the model
(followed through activations, pooling, dropout and flatten, stopping at anything that mixes channels
such as a residual add), falling back, when the model cannot be traced, to module order (the norm and
the weight layer that come next, when their channel counts match).

The key is one safetensors file: per parameter the extracted positions (int32 indices, or a packed
bit mask when that is smaller) and the original values, with a JSON header holding the config, a
SHA-256 of every tensor of the locked model, the fingerprint of the original model and a SHA-256 of
the payload; it is written readable by its owner only (0600). With a passphrase the whole key is sealed
with AES-256-GCM under a scrypt-derived key (the `cryptography` package); the header of the sealed file
holds only the KDF parameters, salt and nonce, and is authenticated as associated data. Unlocking checks
the key (a plain key for consistency: checksums anyone could recompute; a sealed key is authenticated),
checks that the model is exactly the locked model the key was made for and that the key's original
fingerprint is the one the locked folder recorded, restores, checks the result against the original's
fingerprint, and only then writes anything.

Where each part lives: `config` (what to extract), `units` (unit groups and channel links), `ranking`
(extraction order, applying and restoring entries, tensor hashes), `lock` (lock / unlock in memory),
`keyfile` (the key and its file), `sealing` (passphrase encryption), `utility` (utilities, the ratio ->
utility curve, bisection, plot), `attacks`, `folders` (lock / unlock transformers folders), `layerwise`
(`lock key` / `unlock --layerwise`: one decoder layer at a time).
"""

from .attacks import (FinetuneLoss, attack_finetune, attack_prune, attack_table, classifier_finetune, lm_finetune,
                      prune_plain)
from .config import INDICATORS, SCOPES, UNITS, CoreLockerConfig
from .folders import check_lock_targets, check_unlock_targets, lock_folder, unlock_folder
from .keyfile import (KEY_FORMAT, KEY_VERSION, Key, check_header, is_sealed, key_bytes, key_file_bytes,
                      passphrase_from_user, read_key, save_key)
from .lock import lock_key, unlock_key
from .ranking import Extraction, Ranking, apply_extraction, fingerprint, restore_values, tensor_hashes
from .sealing import (PASSPHRASE_ENV, SCRYPT, SCRYPT_MAX, SEALED_FORMAT, SEALED_VERSION, check_kdf, seal,
                      sealed_header)
from .units import ChannelLinks, Members, UnitGroup, channel_links, unit_groups
from .utility import (RatioSearch, Utility, balanced_accuracy, classifier_utility, default_utility, evaluate_at,
                      extracted, find_ratio, lm_utility, plot_curves, utility_curve)

__all__ = ["ChannelLinks", "CoreLockerConfig", "Extraction", "FinetuneLoss", "INDICATORS", "KEY_FORMAT",
           "KEY_VERSION", "Key", "Members", "PASSPHRASE_ENV", "Ranking", "RatioSearch", "SCOPES", "SCRYPT",
           "SCRYPT_MAX", "SEALED_FORMAT", "SEALED_VERSION", "UNITS", "UnitGroup", "Utility", "apply_extraction",
           "attack_finetune", "attack_prune", "attack_table", "balanced_accuracy", "channel_links", "check_header",
           "check_kdf", "check_lock_targets", "check_unlock_targets", "classifier_finetune", "classifier_utility",
           "default_utility", "evaluate_at", "extracted", "find_ratio", "fingerprint", "is_sealed", "key_bytes",
           "key_file_bytes", "lm_finetune", "lm_utility", "lock_folder", "lock_key", "passphrase_from_user",
           "plot_curves", "prune_plain", "read_key", "restore_values", "save_key", "seal", "sealed_header",
           "tensor_hashes", "unit_groups", "unlock_folder", "unlock_key", "utility_curve"]
