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

from checkpoints.layout import LoadedModel, ParamsBuilder
from checkpoints.loader import (
    checkpoint_format,
    load_checkpoint,
    load_gguf,
    load_hf_dir,
    load_quantized,
    resolve_model_path,
)
from checkpoints.orbax_io import load_orbax, save_orbax
from serving.models.layout import param_shapes

__all__ = ["LoadedModel", "ParamsBuilder", "checkpoint_format", "load_checkpoint", "load_gguf",
           "load_hf_dir", "load_orbax", "load_quantized", "param_shapes", "resolve_model_path",
           "save_orbax"]
