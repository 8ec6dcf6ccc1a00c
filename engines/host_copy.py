"""Host lists onto the model's device: on a GPU through pinned memory and a copy that does not block the host (the
caching host allocator keeps a pinned block until the copy that reads it is done), elsewhere as torch.tensor makes
them. A step's inputs are built from Python ints (the policy's rows, the tokens): this is their one way down."""

from __future__ import annotations

import torch


def to_device(values: list, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
