"""mxddp: memory-lean data-parallel training (Megatron-core's DDP and distributed optimizer) in C++.

``mxddp._C`` is the extension module (thin bindings of the C++ library); ``mxddp.torch`` wraps a
PyTorch module in Megatron-core's API. See docs/python.md.
"""
from mxddp._C import Error  # noqa: F401  (mxddp's errors are RuntimeErrors of this type)

__version__ = "0.1.0"
__all__ = ["Error", "__version__"]
