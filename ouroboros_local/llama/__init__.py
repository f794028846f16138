"""llama.cpp binding layer: the only code that touches ctypes."""

from . import huge_pages
from .binding import (Batch, Context, ContextParams, Device, Model, TextStream, backend_init,
                      chosen_gpu, default_threads, devices, library_identity, offload_gpus, quantize,
                      supports_gpu_offload, system_info)

__all__ = ["Batch", "Context", "ContextParams", "Device", "Model", "TextStream", "backend_init", "chosen_gpu",
           "default_threads", "devices", "huge_pages", "library_identity", "offload_gpus", "quantize",
           "supports_gpu_offload", "system_info"]
