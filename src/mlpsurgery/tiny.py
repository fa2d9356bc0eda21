"""Tiny random models of every supported architecture, built from configs (no downloads).

They exist so that tests, examples and dry runs of the CLI (`mlpsurgery inspect tiny:llama`)
exercise the real `transformers` classes of each architecture in milliseconds. Every tiny model
shares one byte-level tokenizer (256 byte tokens + 4 specials), so real text runs through them.
"""

from __future__ import annotations

import torch
import transformers as T
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 260  # 256 bytes + <pad> <s> </s> <unk>
PAD, BOS, EOS, UNK = 256, 257, 258, 259

DECODERS = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo", "ernie4_5", "ministral", "seed_oss", "granite",
            "starcoder2", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "cohere", "cohere2", "olmo2", "olmo3",
            "exaone4", "gpt2", "gpt_neox", "opt")
ENCODERS = ("bert", "roberta", "xlm-roberta", "distilbert")
ARCHITECTURES = DECODERS + ENCODERS


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges: one token per UTF-8 byte."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel.alphabet() is the 256 printable stand-ins for bytes, in no particular order;
    # sort them so token ids are stable across runs.
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    specials = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": UNK}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.model_max_length = 1 << 20
    return fast


def tiny_config(arch: str, **overrides) -> T.PretrainedConfig:
    """A config of `arch` with width 32, MLP width 64, 2 layers, 4 heads (2 KV groups where GQA exists)."""
    ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=128, **ids)
    if arch == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=128,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    elif arch == "opt":
        cfg = T.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                          max_position_embeddings=128, word_embed_proj_dim=32, dropout=0.0, **ids)
    elif arch == "distilbert":
        cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4,
                                 max_position_embeddings=128, dropout=0.0, attention_dropout=0.0, pad_token_id=PAD)
    elif arch in ENCODERS:
        klass = {"bert": T.BertConfig, "roberta": T.RobertaConfig, "xlm-roberta": T.XLMRobertaConfig}[arch]
        kw = dict(common)
        if arch != "bert":
            # RoBERTa numbers positions from pad_token_id + 1, so the table must reach past the pad id.
            kw["max_position_embeddings"] = PAD + 2 + 256
        cfg = klass(**kw, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=2)
    elif arch == "gpt_neox":
        cfg = T.GPTNeoXConfig(**common, hidden_dropout=0.0, attention_dropout=0.0)
    else:
        klass = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
                 "gemma": T.GemmaConfig, "gemma2": T.Gemma2Config, "gemma3_text": T.Gemma3TextConfig,
                 "phi3": T.Phi3Config, "smollm3": T.SmolLM3Config, "olmo": T.OlmoConfig,
                 "ernie4_5": T.Ernie4_5Config, "ministral": T.MinistralConfig, "seed_oss": T.SeedOssConfig,
                 "granite": T.GraniteConfig, "starcoder2": T.Starcoder2Config, "phi": T.PhiConfig,
                 "cohere": T.CohereConfig, "cohere2": T.Cohere2Config, "olmo2": T.Olmo2Config,
                 "olmo3": T.Olmo3Config, "exaone4": T.Exaone4Config}.get(arch)
        if klass is None:
            raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(ARCHITECTURES)}")
        kw = dict(common, num_key_value_heads=2)
        if arch in ("gemma", "gemma2", "gemma3_text", "qwen3", "seed_oss"):
            kw["head_dim"] = 16  # heads x head_dim = 64, not the width 32: as in Qwen3, Gemma 2 / 3, Seed-OSS
        if arch == "ministral":
            kw["head_dim"] = 8
        if arch == "qwen2":
            kw["use_sliding_window"] = False
        if arch == "smollm3":
            kw["no_rope_layer_interval"] = 2  # every second layer without rotary positions (NoPE), as SmolLM3's 4th
        if arch == "ministral":  # a window shorter than the tests' texts, on every second layer
            kw.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
        if arch == "seed_oss":
            kw["attention_out_bias"] = True
        if arch == "granite":  # multipliers away from 1, so that the tests see what they scale
            kw.update(residual_multiplier=0.5, embedding_multiplier=4.0, attention_multiplier=0.25, logits_scaling=2.0)
        if arch == "starcoder2":
            kw.update(residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)
        if arch == "phi":
            kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        if arch in ("olmo2", "olmo3", "exaone4"):
            # no norm before the MLP: the tiny model's MLP outputs (~1e-4) would sit in the eps regime of the norm
            # after it, where no real checkpoint's do
            kw["rms_norm_eps"] = 1e-10
        if arch in ("cohere2", "olmo3", "exaone4"):  # a window shorter than the tests' texts, on every second layer
            kw.update(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
        cfg = klass(**kw)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    if arch == "smollm3" and "no_rope_layers" not in overrides:  # a per-layer list: the config's own rule at the count
        cfg.no_rope_layers = T.SmolLM3Config(num_hidden_layers=cfg.num_hidden_layers,
                                             no_rope_layer_interval=cfg.no_rope_layer_interval).no_rope_layers
    return cfg


def tiny_model(arch: str, seed: int = 0, task: str = "auto", **overrides) -> T.PreTrainedModel:
    """A randomly initialised tiny model (eval mode). task: auto | causal-lm | encoder | classifier."""
    cfg = tiny_config(arch, **overrides)
    if task == "auto":
        task = "encoder" if arch in ENCODERS else "causal-lm"
    klass = {"causal-lm": T.AutoModelForCausalLM, "encoder": T.AutoModel,
             "classifier": T.AutoModelForSequenceClassification}[task]
    torch.manual_seed(seed)
    model = klass.from_config(cfg)
    # Random init gives norms weight 1 (or 0 for Gemma's 1+w); perturb every parameter so that
    # tests of "identical logits" cannot pass through a symmetric or degenerate init.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Synthetic models of real size: random weights written straight to sharded safetensors


def synthetic_llama_config(n_params: float, vocab_size: int = 49152, d: int | None = None) -> T.LlamaConfig:
    """A llama config (SwiGLU, grouped-query attention with 4 query heads per KV head, tied embeddings) of about
    `n_params` parameters: width `d`, by default 2048 up to 1.5 B, 2560 up to 4 B, 4096 above; the depth fills
    the rest."""
    d = d or (2048 if n_params <= 1.5e9 else 2560 if n_params <= 4e9 else 4096)
    heads = max(1, d // 64)
    kv = max(1, heads // 4)
    h = int(round(8 / 3 * d / 256)) * 256
    per_layer = 2 * d * d + 2 * d * (kv * 64) + 3 * d * h + 2 * d
    layers = max(1, int(round((n_params - vocab_size * d) / per_layer)))
    return T.LlamaConfig(vocab_size=vocab_size, hidden_size=d, intermediate_size=h, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=True, dtype="bfloat16")


def write_synthetic(folder, n_params: float = 2e9, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 1 << 30,
                    tokenizer_from=None, seed: int = 0, vocab_size: int = 49152, d: int | None = None) -> int:
    """Write a random-weight llama of about `n_params` parameters to `folder` as a transformers checkpoint:
    config.json, model-0000k-of-0000n.safetensors shards of at most `shard_bytes` with their index, and the
    tokenizer files of `tokenizer_from` (a folder; e.g. models.smollm2_dir(), whose vocabulary the config uses).
    One shard is in memory at a time, never the model. Returns the parameter count. For benchmarks and tests of
    memory at scale; its text is noise."""
    import json
    import math
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from .files import check_out

    folder = Path(folder)
    check_out(folder, inputs=[tokenizer_from])  # never into a folder that holds anything (the user's files)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_llama_config(n_params, vocab_size, d)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in T.LlamaForCausalLM(cfg).state_dict().items()
                  if n != "lm_head.weight"]  # tied to the embeddings
    g = torch.Generator().manual_seed(seed)
    groups: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for name, shape in shapes:
        nbytes = itemsize * math.prod(shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map, total, count = {}, 0, 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=g) * 0.02).to(dtype)
            shard[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
            count += t.numel()
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        del shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}, indent=1))
    cfg.dtype = str(dtype).removeprefix("torch.")
    cfg.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_from) / name
            if src.exists():
                shutil.copy(src, folder / name)
    return count
