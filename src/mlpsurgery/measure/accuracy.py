"""Classification accuracy: of a model with a classification head, or of a linear probe
(scikit-learn logistic regression) on mean-pooled final hidden states of any model."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..data import LabelledSet
from ..errors import MLPSurgeryError


def batches(tokenizer, texts: list[str], max_len: int, batch_size: int):
    """Padded, truncated token batches of `texts`, in order."""
    for s in range(0, len(texts), batch_size):
        enc = tokenizer(texts[s:s + batch_size], padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        yield {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def _hidden(model: nn.Module, enc: dict) -> Tensor:
    out = model(**enc, output_hidden_states=True)
    if getattr(out, "last_hidden_state", None) is not None:
        return out.last_hidden_state
    return out.hidden_states[-1]


def embed(model: nn.Module, tokenizer, texts: list[str], max_len: int = 128, batch_size: int = 32,
          progress: bool = True) -> Tensor:
    """Mean-pooled (over non-padding tokens) final hidden states: (N, d)."""
    device = next(model.parameters()).device
    base = getattr(model, "base_model", model)
    out = []
    model.eval()
    with torch.no_grad():
        for enc in tqdm(list(batches(tokenizer, texts, max_len, batch_size)), desc="embed", disable=not progress):
            enc = {k: v.to(device) for k, v in enc.items()}
            h = _hidden(base, enc).float()
            m = enc["attention_mask"].unsqueeze(-1).float()
            out.append(((h * m).sum(1) / m.sum(1).clamp_min(1)).cpu())
    return torch.cat(out)


def probe_accuracy(model: nn.Module, tokenizer, train: LabelledSet, test: LabelledSet, max_len: int = 128,
                   batch_size: int = 32, progress: bool = True, seed: int = 0) -> dict:
    """Accuracy of a logistic-regression probe trained on `train` embeddings, measured on `test`."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    xtr = embed(model, tokenizer, train.texts, max_len, batch_size, progress).numpy()
    xte = embed(model, tokenizer, test.texts, max_len, batch_size, progress).numpy()
    scaler = StandardScaler().fit(xtr)
    clf = LogisticRegression(max_iter=2000, random_state=seed).fit(scaler.transform(xtr), train.labels)
    acc = float((clf.predict(scaler.transform(xte)) == test.labels).mean())
    return {"accuracy": acc, "n_train": len(train), "n_test": len(test), "classes": test.num_classes,
            "method": "logistic-regression probe on mean-pooled final hidden states"}


def predict(model: nn.Module, tokenizer, texts: list[str], max_len: int = 128, batch_size: int = 32,
            progress: bool = True) -> Tensor:
    """Class predictions of a model with a sequence-classification head."""
    if not hasattr(model, "num_labels") or not hasattr(model, "config") or \
            not any(a.endswith("ForSequenceClassification") for a in [type(model).__name__]):
        raise MLPSurgeryError(f"{type(model).__name__} has no classification head; use probe_accuracy")
    device = next(model.parameters()).device
    preds = []
    was = model.training
    model.eval()
    with torch.no_grad():
        for enc in tqdm(list(batches(tokenizer, texts, max_len, batch_size)), desc="predict", disable=not progress):
            enc = {k: v.to(device) for k, v in enc.items()}
            preds.append(model(**enc).logits.argmax(-1).cpu())
    model.train(was)
    return torch.cat(preds)


def accuracy(model: nn.Module, tokenizer, data: LabelledSet, max_len: int = 128, batch_size: int = 32,
             progress: bool = True) -> float:
    """Accuracy of a sequence classifier on a labelled set."""
    pred = predict(model, tokenizer, data.texts, max_len, batch_size, progress)
    return float((pred == torch.tensor(data.labels)).float().mean())
