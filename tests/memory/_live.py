"""Live-tensor accounting for the planner's measuring tests."""

from __future__ import annotations


class LiveTensors:
    """A dispatch mode that records the peak bytes of the tensors created under it and still alive (each
    storage counted once, freed when its tensor is): what an experts forward allocates, not its inputs."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter._record(out)
                return out

        self.mode, self.live, self.peak, self._sizes = Mode(), 0, 0, {}

    def _record(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t._base is None:
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if size and ptr not in self._sizes:
                    self._sizes[ptr] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self.live -= self._sizes.pop(ptr, 0)
