"""NSN surgery layer by layer from the checkpoint's files (layerwise.py): every chosen projection of one decoder
layer at a time becomes its SVD-initialised NestedLinear (surgery.py's own `nest_slot`), is appended to the
output and dropped, so a model larger than RAM is nested in the memory of one layer plus the embeddings. The
folder holds what `nest` + `save` write without training (tests/test_layerwise_reshape.py checks it bit for bit);
multi-rank training then runs on that folder as on any other (it needs the whole model, or FSDP under torchrun).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ...io import record
from ...layerwise import LayerStream, rewrite
from ...sites import parse_layers
from .ranks import nested_flops
from .surgery import NSNConfig, _slots, check_config, max_rank, nest_slot, nested_linears


def nest_layerwise(folder: str | Path, out: str | Path, cfg: NSNConfig, dtype=None, tokenizer=None,
                   overwrite: bool = False, inputs=(), source_name: str | None = None, progress: bool = True) -> dict:
    """Nest the checkpoint in `folder` one layer at a time and save the result to `out` (what `nest` with no
    training steps writes)."""
    check_config(cfg)
    stream = LayerStream(Path(folder), dtype=dtype)
    model = stream.model
    layers = set(parse_layers(cfg.layers, stream.n_layers))
    count = 0

    def work(i: int) -> None:
        nonlocal count
        if i in layers:
            for slot in list(_slots(model, cfg.modules, [i])):
                nest_slot(slot, cfg)
                count += 1

    rewrite(stream, out, work, "SVD (layer by layer)", tokenizer=tokenizer, overwrite=overwrite, inputs=inputs,
            source_name=source_name, progress=progress,
            finish=lambda: record(model, "nsn", asdict(cfg), projections=count))
    return {"out": str(out), "config": asdict(cfg), "projections": len(nested_linears(model)),
            "max_rank": max_rank(model), "full_rank_flops_fraction": nested_flops(model)["fraction"],
            "layerwise": True, "dtype": str(stream.dtype).split(".")[-1]}
