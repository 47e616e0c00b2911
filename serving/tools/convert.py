"""`xlaserve convert`: any checkpoint the engine reads -> an orbax directory.

With `quantization`, the stored weights are already quantized: GGUF blocks of
the matching type are kept, int4 layers are fitted by GPTQ on the shipped
calibration text (gptq.py: ~3x lower KL than rounding at group 64, but tens
of seconds on CPU, so done once here rather than at every start-up), and the
rest is rounded (checkpoints/quantizers.py).
"""

from __future__ import annotations

import dataclasses

import checkpoints
from checkpoints import load_quantized
from checkpoints.orbax_io import save_orbax
from checkpoints.quantizers import quantize_params
from serving.tools import gptq


def convert(model: str, output: str, quantization: str | None = None) -> str:
  """Writes `model` (preset, HF dir, GGUF, orbax) to `output`; returns the path written."""
  if quantization:
    loaded = load_quantized(model, quantization)
    params = (gptq.calibrated_int4(loaded) if quantization == "int4"
              else quantize_params(loaded.params, quantization))
    loaded = dataclasses.replace(loaded, params=params)
  else:
    loaded = checkpoints.load_checkpoint(model)
  return save_orbax(loaded, output)
