"""Root conftest: skip doctest collection of optional integrations whose extra is not installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("trl") is None:
    # planners, checkpoint and batch need no TRL; the package docstring, config and trainer do
    collect_ignore += [f"diskreplay/integrations/trl/{m}.py" for m in ("__init__", "config", "trainer")]
if importlib.util.find_spec("torchrl") is None or importlib.util.find_spec("tensordict") is None:
    collect_ignore.append("diskreplay/integrations/torchrl.py")
