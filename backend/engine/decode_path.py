"""The layer descriptions under the name ``attention.py`` still reads them by.

The vocabulary is ``models/layer_description.py`` (a family describes its layers from its
config with it, before the engine loads anything) and the choice of executor is
``plan/decode_path.py``. ``attention.py`` is being edited for issue 45; this module goes
when its ``decode_path.GroupedQueryAttention`` reads ``layer_description`` instead.
"""

from hybridmoe.backend.models.layer_description import GroupedQueryAttention

__all__ = ["GroupedQueryAttention"]
