"""Import hook for flexrollout's Unsloth plugin (see flexrollout/integrations/unsloth.py).

`flexrollout-unsloth.pth` imports this module at interpreter start-up only when
UNSLOTH_FAST_INFERENCE=1; `import flexrollout.unsloth` calls `activate()` explicitly. It imports
nothing heavy: once `unsloth` has finished importing, the plugin is installed (or at once, when
`unsloth` is already imported).
"""
import importlib.abc
import sys

_TARGET = "unsloth"


def _install():
    from flexrollout.integrations.unsloth import install

    install()


class _Loader(importlib.abc.Loader):
    """The real loader of `unsloth`, then the plugin."""

    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        spec = module.__spec__
        try:
            self.real.exec_module(module)
        finally:
            spec.loader = module.__loader__ = self.real
        _install()

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `unsloth` with the other finders and wraps its loader (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def activate():
    """Install the plugin now if `unsloth` is imported, else when it is."""
    if _TARGET in sys.modules:
        _install()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


activate()
