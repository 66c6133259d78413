"""shardc's version, in a module of its own: the shard metadata, the manifest and the CLI record it,
and a leaf module lets them import it without importing the package facade (``shardc/__init__``),
which sits above every package."""

__version__ = "0.1.0"
