"""`python -m launch_with MODULE:FACTORY COMMAND [--flags]`: the `xlaserve` launcher with a
test's engine factory (a fake runner, injected faults) in place of checkpoint loading.

The product command has no switch for this: tests call `serving.launcher.run(build_engine=)`
through this script, with the factory's folder on PYTHONPATH (server_procs.subprocess_env).
"""

import importlib
import sys

from serving import launcher

if __name__ == "__main__":
  module, _, name = sys.argv.pop(1).partition(":")
  launcher.run(build_engine=getattr(importlib.import_module(module), name))
