"""Session-wide test set-up: JAX on CPU with the persistent compilation cache."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

_CACHE = os.environ.get("XLASERVE_TEST_CACHE",
                        os.path.join(os.path.dirname(__file__), "..", ".jax_cache"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
