"""Checkpoint loading: one entry point for every format the engine serves.

`load_checkpoint(model)` accepts
  1. a preset name from configs/ (e.g. `smollm2-135m-instruct`), resolved to
     the file its pip package ships (`checkpoints.presets`);
  2. an orbax directory written by `save_orbax` (it has a marker file);
  3. a Hugging Face directory (config.json + safetensors, `checkpoints.hf`);
  4. a `.gguf` file (`checkpoints.gguf`),
and returns a `LoadedModel(config, params, tokenizer, source)` with the params
pytree of docs/structure.md as numpy arrays (float32 or bfloat16).
Unsupported architectures, dtypes and quantization types raise ValueError
naming the unsupported thing; `checkpoint_format(model)` finds the format (and
raises the same errors) without reading any weights.
"""

import importlib

# Exported name -> the module that defines it, imported on first use (PEP 562), so that
# light users (`checkpoints.presets` from the launcher's flags) do not pay for numpy,
# ml_dtypes and the loaders.
_EXPORTS = {
    "LoadedModel": "checkpoints.layout", "ParamsBuilder": "checkpoints.layout",
    "checkpoint_format": "checkpoints.loader", "load_checkpoint": "checkpoints.loader",
    "load_gguf": "checkpoints.loader", "load_hf_dir": "checkpoints.loader",
    "load_quantized": "checkpoints.loader", "resolve_model_path": "checkpoints.loader",
    "load_orbax": "checkpoints.orbax_io", "save_orbax": "checkpoints.orbax_io",
    "param_shapes": "serving.models.layout",
}
__all__ = ["LoadedModel", "ParamsBuilder", "checkpoint_format", "load_checkpoint", "load_gguf",
           "load_hf_dir", "load_orbax", "load_quantized", "param_shapes", "resolve_model_path",
           "save_orbax"]  # = sorted(_EXPORTS), written out for readers and static checks


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'checkpoints' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value
