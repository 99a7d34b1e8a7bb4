"""Start-up hook (run from ``lightning_protrain.pth`` by the ``site`` module): registers the
"protrain" strategy with Lightning when -- and only if -- Lightning is imported.

It imports neither torch nor Lightning: it puts a finder on ``sys.meta_path`` that waits for the
top-level ``lightning`` package (whose ``__init__`` loads ``lightning.fabric`` and
``lightning.pytorch``), lets it load normally, then imports ``lightning_protrain``, which
registers the strategy in both registries. It never raises; ``LIGHTNING_PROTRAIN_AUTOREGISTER=0``
turns it off (then ``import lightning_protrain`` registers explicitly).
"""

import os
import sys

ENV_SWITCH = "LIGHTNING_PROTRAIN_AUTOREGISTER"


def _register() -> None:
    try:
        import lightning_protrain  # noqa: F401  (registers on import)
    except Exception as e:  # noqa: BLE001 - a start-up hook must never break the user's import
        import warnings

        warnings.warn(f"lightning-protrain could not register the 'protrain' strategy: {type(e).__name__}: {e}")


class _Loader:
    """Delegates to Lightning's own loader, then registers once the package is initialised."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "lightning":
            return None
        try:
            sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
            import importlib.util

            spec = importlib.util.find_spec(name)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
            return spec
        except Exception:  # noqa: BLE001
            return None


def install() -> None:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if "lightning" in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


try:
    install()
except Exception:  # noqa: BLE001
    pass
