"""labkit: the FP8 KV-cache decode lab (paged MLA pool, three decode paths, measurement)."""
import os as _os

import torch as _torch

if not _os.environ.get("TRITON_INTERPRET") and not _torch.cuda.is_available():
    # With no CUDA device the Triton kernels run in Triton's CPU interpreter, which must be
    # chosen before triton is first imported.
    _os.environ["TRITON_INTERPRET"] = "1"

from . import config, kvpool, reference  # noqa: E402,F401

__version__ = "0.1.0"
