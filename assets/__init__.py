"""Data files installed with hybridmoe: the model catalogue and the target models' configs.

A regular package, not a namespace one: ``importlib.resources.files`` of a namespace package
is a MultiplexedPath, whose str() is not a file-system path (``hub.catalogue.assets_dir``).
"""
