"""Package names imported on first use (PEP 562), so that importing the package stays light."""
from importlib import import_module


def lazy_getattr(package: str, table: dict[str, str]):
    """A module ``__getattr__`` for ``package``: ``table[name]`` is the submodule that defines ``name``."""
    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{table[name]}"), name)

    return __getattr__
