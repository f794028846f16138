"""llama.cpp binding layer: the only code that touches ctypes."""

from .binding import (Batch, Context, ContextParams, Model, TextStream, backend_init, default_threads,
                      quantize, supports_gpu_offload, system_info)

__all__ = ["Batch", "Context", "ContextParams", "Model", "TextStream", "backend_init", "default_threads",
           "quantize", "supports_gpu_offload", "system_info"]
