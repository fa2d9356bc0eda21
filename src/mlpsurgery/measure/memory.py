"""Peak live tensor memory of a region of code, on any device.

On CUDA the allocator keeps the statistic (`torch.cuda.max_memory_allocated`). On CPU nothing does, so
`PeakTracker` watches every tensor storage the region creates through PyTorch's dispatcher (a
TorchDispatchMode, the mechanism of PyTorch's own `MemTracker`) and frees it from the count when the
storage dies (weak reference). Peak = bytes alive at the start (the storages of the tensors handed in:
model, optimizer, inputs) + the largest sum of region-created storages alive at one time.

PyTorch's `torch.distributed._tools.mem_tracker.MemTracker` does this too, but refuses models with frozen
parameters (it hooks every parameter's gradient), which rules out LoRA and partial fine-tuning: the cases
a locking defence must measure.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: Tensor):
    """The storage behind `t`; for a sharded tensor (FSDP2's DTensor), this rank's shard's."""
    if type(t) is not Tensor and type(t).__name__ == "DTensor":
        t = t.to_local()
    return t.untyped_storage()


def _storage_bytes(t: Tensor) -> tuple[int, int]:
    st = _storage(t)
    return st.data_ptr(), st.nbytes()


def live_bytes(*objs) -> int:
    """Bytes of the distinct storages behind modules (parameters, buffers, grads), optimizers (state) and tensors."""
    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, Tensor) and t.device.type != "meta":
            ptr, n = _storage_bytes(t)
            if ptr:
                seen[ptr] = n

    for o in objs:
        if isinstance(o, nn.Module):
            for p in o.parameters():
                add(p)
                add(p.grad)
            for b in o.buffers():
                add(b)
        elif isinstance(o, torch.optim.Optimizer):
            for state in o.state.values():
                for v in state.values():
                    add(v)
        else:
            for t in tree_leaves(o):
                add(t)
    return sum(seen.values())


class PeakTracker(TorchDispatchMode):
    """with PeakTracker(model, optimizer, batch) as t: ...;  t.peak is the peak live tensor bytes."""

    def __init__(self, *tracked):
        super().__init__()
        self.base = live_bytes(*tracked)
        self._known = set()  # storage data pointers that existed before or are already counted
        for o in tracked:
            ts = []
            if isinstance(o, nn.Module):
                ts = [*o.parameters(), *o.buffers(), *[p.grad for p in o.parameters() if p.grad is not None]]
            elif isinstance(o, torch.optim.Optimizer):
                ts = [v for s in o.state.values() for v in s.values() if isinstance(v, Tensor)]
            else:
                ts = [t for t in tree_leaves(o) if isinstance(t, Tensor)]
            self._known.update(_storage_bytes(t)[0] for t in ts)
        self.current = 0
        self.region_peak = 0
        self._refs = []

    @property
    def peak(self) -> int:
        return self.base + self.region_peak

    def _release(self, ptr: int, n: int) -> None:
        self.current -= n
        self._known.discard(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # almost every op returns a tensor or a flat tuple of them: only the rest walks the pytree (which costs more
        # than the op itself for the small ops of a deep net)
        if isinstance(out, Tensor):
            leaves = (out,)
        elif type(out) in (tuple, list) and all(type(t) is Tensor or t is None for t in out):
            leaves = out
        else:
            leaves = tree_leaves(out)
        for t in leaves:
            if isinstance(t, Tensor) and t.device.type != "meta":
                st = t.untyped_storage() if type(t) is Tensor else _storage(t)
                ptr, n = st.data_ptr(), st.nbytes()
                if ptr and ptr not in self._known:
                    self._known.add(ptr)
                    self.current += n
                    self.region_peak = max(self.region_peak, self.current)
                    self._refs.append(weakref.ref(st, lambda _, p=ptr, n=n: self._release(p, n)))
        return out


# --------------------------------------------------------------------------------------------------
# The process's resident memory (Linux): the kernel's high-water mark, resettable so one stage can be measured


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count of this process at its current RSS (Linux: /proc/self/clear_refs);
    False where that is not possible (then `peak_rss` is the peak since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int | None:
    """Peak resident memory of this process in bytes since it started or since `reset_peak_rss` (VmHWM)."""
    found = _status_bytes("VmHWM")
    if found is not None:
        return found
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
