"""Optional integrations with training libraries, each imported on demand.

Importing ``diskreplay`` never imports a training library; import the
integration module itself (``import diskreplay.integrations.trl``, ``.torchrl``,
``.ray`` or ``.transferqueue``) to pull in its library. Install the extra first:
``pip install 'diskreplay[trl]'`` (``[torchrl]``, ``[ray]``, ``[transferqueue]``).

>>> import diskreplay.integrations
>>> "trl" in diskreplay.integrations.__all__
True
"""

__all__ = ["ray", "torchrl", "transferqueue", "trl"]
