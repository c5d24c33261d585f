"""labkit: the FP8 KV-cache decode lab (paged MLA pool, three decode paths, measurement)."""
import os as _os

import torch as _torch

if not _os.environ.get("TRITON_INTERPRET") and not _torch.cuda.is_available():
    # With no CUDA device the Triton kernels run in Triton's CPU interpreter, which must be
    # chosen before triton is first imported.
    _os.environ["TRITON_INTERPRET"] = "1"

# Run from a source tree without installing (e.g. on a GPU machine with no network), let
# ``labkit.kernels`` resolve to the top-level kernels/ folder, as the installed package maps it.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)  # noqa: F821 - the package's own search path

from . import config, kvpool, reference  # noqa: E402,F401

__version__ = "0.1.0"
