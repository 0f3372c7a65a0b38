"""Root conftest: skip doctest collection of optional integrations whose extra is not installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("trl") is None:
    collect_ignore.append("diskreplay/integrations/trl.py")
if importlib.util.find_spec("torchrl") is None or importlib.util.find_spec("tensordict") is None:
    collect_ignore.append("diskreplay/integrations/torchrl.py")
