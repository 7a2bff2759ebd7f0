"""A counter of the host's reads of tensor values that wait for the work in flight: on a GPU each such read
(`.item()`, `bool()`, `float()`, ...) of a tensor the current step computed waits for every kernel queued
before it, and the GPU then idles while the host queues the next step. On the CPU nothing is in flight, so
the counter records where the code would wait: reads of tensors produced since the current step began."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

VALUE_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}


class StepHostReads(TorchFunctionMode):
    """Per step (`new_step` marks where one begins), how many value reads hit a tensor of that step."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step: list[int] = []
        self._produced: dict[int, weakref.ref[torch.Tensor]] = {}

    def new_step(self) -> None:
        self.per_step.append(0)
        self._produced = {}

    def _of_this_step(self, tensor: Any) -> bool:
        ref = self._produced.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in VALUE_READS and self.per_step and self._of_this_step(args[0]):
            self.per_step[-1] += 1
        result = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(result):
            if isinstance(leaf, torch.Tensor):
                self._produced[id(leaf)] = weakref.ref(leaf)
        return result
