"""Shared pieces of the CoreLocker benchmarks: the two trained models they lock (MiniLM fine-tuned on
Reuters R8, a small BatchNorm CNN trained on scikit-learn's digits), cached under runs/corelocker/ so
that every benchmark reuses them, and their utility measurements.

    python benchmarks/corelocker_common.py        # train (or find) both models and print their accuracy
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

import harness
import mlpsurgery as ms
from mlpsurgery.methods.corelocker import Utility
from mlpsurgery.train import FitConfig, classifier_loss, fit, step_rng, trainable

RUNS = harness.ROOT / "runs" / "corelocker"
MINILM_DIR = RUNS / "minilm-r8"
CNN_FILE = RUNS / "digits-cnn.safetensors"
FT_STEPS, FT_BATCH, FT_LR, MAX_LEN = 300, 16, 1e-4, 128


def machine() -> str:
    return harness.machine("{arch} CPU x{threads} threads, torch {torch}, Python {python}")


# ---- MiniLM + R8 ------------------------------------------------------------------------------------

def r8_splits():
    """R8 train split into the fine-tuning part (90%) and a calibration part (10%, stratified, seed 0);
    the R8 test set for every reported accuracy."""
    train = ms.read_labelled("r8-train")
    test = ms.read_labelled("r8-test", classes=train.classes)
    finetune, calib = train.split(0.1, seed=0)
    return finetune, calib, test


def minilm_r8(progress: bool = True):
    """all-MiniLM-L6-v2 with an 8-class head fine-tuned on 90% of R8 train (FT_STEPS steps of FT_BATCH,
    AdamW lr FT_LR, warm-up + cosine), cached in runs/corelocker/minilm-r8 (resumable checkpoints)."""
    if (MINILM_DIR / "surgery.json").exists():
        return ms.load_model(str(MINILM_DIR), task="classifier")
    finetune, _, _ = r8_splits()
    loaded = ms.load_model("minilm", task="classifier", num_labels=8)
    model, tok = loaded.model.train(), loaded.tokenizer
    fit(trainable(model), classifier_loss(model, tok, finetune, FT_BATCH, max_len=MAX_LEN, seed=0),
        FitConfig(steps=FT_STEPS, lr=FT_LR, warmup=0.1, weight_decay=0.01, checkpoint_every=25),
        checkpoint_dir=RUNS / "minilm-r8-ckpt", progress=progress, desc="fine-tune MiniLM on R8")
    model.eval()
    ms.save(model, MINILM_DIR, tokenizer=tok)
    return ms.load_model(str(MINILM_DIR), task="classifier")


def r8_utilities(tok, test, calib=None) -> dict[str, Utility]:
    from mlpsurgery.methods.corelocker import classifier_utility

    out = {"accuracy": classifier_utility(tok, test, max_len=MAX_LEN),
           "balanced": classifier_utility(tok, test, max_len=MAX_LEN, balanced=True)}
    if calib is not None:
        out["calib"] = classifier_utility(tok, calib, max_len=MAX_LEN)
    return out


# ---- a small BatchNorm CNN on scikit-learn's digits --------------------------------------------------

class DigitsCNN(nn.Module):
    """Five 3x3 conv layers with BatchNorm (32-64-64-128-128 channels) and one linear classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        chans = [1, 32, 64, 64, 128, 128]
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
            if i == 2:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(chans[-1], classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def digits():
    """(x_train, y_train, x_test, y_test): 8x8 images scaled to [0, 1], stratified 80/20 split, seed 0."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    return xtr, ytr, xte, yte


def cnn_loss(model: nn.Module, x, y, batch: int = 64, seed: int = 0):
    def loss_fn(step: int):
        idx = torch.randint(0, len(x), (batch,), generator=step_rng(seed, step))
        return nn.functional.cross_entropy(model(x[idx]), y[idx])

    return loss_fn


def cnn_accuracy(x, y) -> Utility:
    def acc(model):
        was = model.training
        model.eval()
        with torch.no_grad():
            pred = model(x).argmax(-1)
        model.train(was)
        return float((pred == y).float().mean())

    return Utility(acc, "accuracy", True, f"digits test ({len(y)} images)", 0.1)


def digits_cnn(progress: bool = True) -> DigitsCNN:
    """The CNN trained for 600 steps of 64 images (Adam-style AdamW, lr 1e-3), cached."""
    from safetensors.torch import load_model, save_model

    model = DigitsCNN()
    if CNN_FILE.exists():
        load_model(model, str(CNN_FILE))
        return model.eval()
    torch.manual_seed(0)
    model = DigitsCNN().train()
    xtr, ytr, _, _ = digits()
    fit(trainable(model), cnn_loss(model, xtr, ytr), FitConfig(steps=600, lr=1e-3, warmup=0.05), progress=progress,
        desc="train digits CNN")
    RUNS.mkdir(parents=True, exist_ok=True)
    save_model(model.eval(), str(CNN_FILE))
    return model


def digits_cnn_test():
    """The trained digits CNN, its metrics function on the test split ({"accuracy": ...}) and the test size."""
    model = digits_cnn()
    _, _, xte, yte = digits()
    acc = cnn_accuracy(xte, yte)
    return model, (lambda m: {"accuracy": acc(m)}), len(yte)


def write_json(name: str, obj) -> Path:
    """A result of these benchmarks, runs/corelocker/NAME."""
    return harness.write_json(RUNS / name, obj, indent=2, default=str)


def write_result(name: str, result: dict, t0: float) -> tuple[Path, dict]:
    """runs/corelocker/NAME: `result` followed by the machine, the command line and the seconds since t0; its path
    and the result written."""
    result = {**result, "machine": machine(), "command": " ".join(sys.argv), "seconds": time.perf_counter() - t0}
    return write_json(name, result), result


# ---- SmolLM2 ---------------------------------------------------------------------------------------

def smollm2_perplexity(max_tokens: int):
    """SmolLM2-135M (loaded) and its metrics function: {"perplexity": ...} on the first `max_tokens` held-out
    Persuasion tokens, windows of 512."""
    from mlpsurgery.methods.corelocker import lm_utility

    loaded = ms.load_model("smollm2")
    corpus = ms.load_corpus(None, loaded.tokenizer)
    ppl = lm_utility(corpus.heldout, block_len=512, max_tokens=max_tokens, bos_id=corpus.bos)
    return loaded, lambda m: {"perplexity": ppl(m)}


if __name__ == "__main__":
    harness.parser(__doc__).parse_args()
    cnn = digits_cnn()
    _, _, xte, yte = digits()
    print("digits CNN test accuracy", cnn_accuracy(xte, yte)(cnn))
    loaded = minilm_r8()
    _, calib, test = r8_splits()
    u = r8_utilities(loaded.tokenizer, test)
    print("MiniLM-R8 test accuracy", u["accuracy"](loaded.model), "balanced", u["balanced"](loaded.model),
          file=sys.stderr)
