"""Paged attention over a shared KV page pool: references and Pallas kernels.

Modules: ``reference`` (pure jnp, the ground truth and the CPU path),
``decode_tpu`` / ``ragged_tpu`` (Mosaic TPU), ``decode_gpu`` / ``ragged_gpu``
(Triton), ``tiles`` (the ragged query-tile schedule), ``tuning`` (block
sizes), ``validation`` (input checks), ``testing`` (poisoned random inputs).
"""
